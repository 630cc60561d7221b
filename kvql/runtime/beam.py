"""Beam search over one hole, through the backend contract: one single-token request per beam and step.

Each step extends every beam by its `width` most likely tokens (or, `sampled`: LMQL's beam_sample,
`width` tokens drawn at the decoder's temperature) and keeps the `width` best sequences by
log-probability. Under a grammar or a token lower bound the log-probabilities are those of the
constrained distribution (the backend's `masked_logprobs`); a beam's partial value is sent as the end
of its prompt and named by `grammar_prefix`, so the constraint covers the whole value.
"""

from __future__ import annotations

import asyncio
import math
import random

from ..backends import base  # the contract only: no torch, no engine


async def beam_search(ctx, plan, prompt_ids: list[int], max_tokens: int, constraint: dict):
    """-> [(value, token ids, log-probability)], best first, at most `width` of them."""
    model, dec, tok = ctx.model, ctx.decoding, ctx.model.tokenizer
    width = dec.width
    if constraint or plan.min_tokens:
        model.require(base.MASKED_LOGPROBS, "beam search under a constraint (log-probabilities of the "
                                            "constrained distribution)")
    eos = model.eos_ids
    active, done = [([], 0.0)], []
    base_seed = dec.seed if dec.seed is not None else random.getrandbits(32)
    penalties = {k: v for k, v in dec.sampling.items() if "penalty" in k}

    def cut(seq):
        guard = ctx.guard_chars(plan, seq)
        return plan.cut(tok.decode(seq, skip_special_tokens=True), guard)

    for step in range(max_tokens):
        requests = []
        for i, (g, _) in enumerate(active):
            opt = dict(max_tokens=1, masked_logprobs=True, ignore_eos=True, **constraint,
                       min_tokens=1 if len(g) < plan.min_tokens else 0)
            if constraint:
                opt["grammar_prefix"] = len(g)
            if dec.sampled:  # seeded per (call, hole, step, beam): every run of the call shares this search
                opt.update(n=width, logprobs=0, temperature=dec.temperature, **dec.sampling,
                           seed=hash((base_seed, tuple(prompt_ids), step, i)) & 0x7FFFFFFF)
            else:
                opt.update(logprobs=width, **penalties)
            requests.append(model.agenerate([prompt_ids + g], **opt))
        results = await asyncio.gather(*requests)
        if not done and len(active) == 1 and not active[0][0]:  # the first step sent the prompt itself
            ctx.sent(len(prompt_ids), results[0][0].cached_tokens)
        candidates = []
        for (g, score), cs in zip(active, results):
            ctx.count(cs[:1])  # the samples of one request share its prompt
            top = {c.logprobs[0].token_id: c.logprobs[0].logprob for c in cs} if dec.sampled else cs[0].logprobs[0].top
            for t, lp in top.items():
                if lp == -math.inf:
                    continue
                new, s = g + [t], score + lp
                seq = g if t in eos else new
                text = tok.decode(seq, skip_special_tokens=True)
                finished = t in eos or len(new) >= max_tokens or \
                    plan.stop_index(text, ctx.guard_chars(plan, seq)) is not None
                candidates.append((s, seq, finished))
        candidates.sort(key=lambda x: -x[0])
        active = []
        for s, g, finished in candidates[:width]:
            if finished:
                done.append((cut(g), g, s))
            else:
                active.append((g, s))
        done.sort(key=lambda x: -x[2])
        if not active or (len(done) >= width and done[width - 1][2] >= max(s for _, s in active)):
            break
    done += [(cut(g), g, s) for g, s in active]
    done.sort(key=lambda x: -x[2])
    return done[:width]
