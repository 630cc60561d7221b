"""Sampler: one next token from one row of logits, under a request's mask and sampling parameters.

Greedy picks and the checks of a mask's result on a CPU row run in numpy: a row is ~50K entries, and
torch's CPU argmax, `any` and `where` over it take 45-95 us each (reductions over a tensor that size are
split across the thread pool), numpy's 1-55 us. Same results: ties and NaN go to the lowest index in both.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...completion import TokenLogprob
from ..request import Request


def _bools(allowed) -> np.ndarray:
    """A mask result as a flat bool array (nonzero: allowed), as given."""
    return torch.as_tensor(allowed).to(device="cpu", dtype=torch.bool).flatten().numpy()


def _allowed(allowed, vocab: int) -> np.ndarray:
    """A mask result as a bool array of `vocab` entries; a shorter one is padded with False (the model's
    vocab may be padded past the tokenizer's). Raises ValueError when it is longer or allows nothing."""
    a = _bools(allowed)
    if a.size < vocab:
        a = np.concatenate([a, np.zeros(vocab - a.size, dtype=bool)])
    elif a.size > vocab:
        raise ValueError(f"mask has {a.size} entries, the model's vocabulary {vocab}")
    if not a.any():
        raise ValueError("the token mask allows no token")
    return a


def _apply_mask(logits: torch.Tensor, allowed) -> torch.Tensor:
    a = torch.from_numpy(_allowed(allowed, logits.numel())).to(logits.device)
    return torch.where(a, logits, float("-inf"))  # (a third of masked_fill(~allowed)'s time)


def _argmax(logits: torch.Tensor, allowed=None) -> int:
    """The index of the largest of `logits` (a float32 row) among `allowed` (a mask result; None: all);
    ties and NaN as `torch.argmax` (the lowest index)."""
    if logits.device.type != "cpu":
        return int(torch.argmax(logits if allowed is None else _apply_mask(logits, allowed)))
    row = logits.numpy()
    if allowed is None:
        return int(row.argmax())
    return int(np.where(_allowed(allowed, row.size), row, -np.inf).argmax())


def _adjusted(p) -> bool:
    """Whether `_adjust` changes a row for parameters `p` (else the row is used as it is: greedy stays exact)."""
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty or p.presence_penalty or p.logit_bias)


def _adjust(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """A copy of the row with the penalties, then the logit bias: repetition penalty over prompt and output ids
    (a positive logit divided by it, a negative one multiplied, as in CTRL and transformers); frequency and
    presence penalties over output ids (as in OpenAI's API and vLLM); each `logit_bias` value added to its
    token's logit (OpenAI's, as transformers' SequenceBiasLogitsProcessor adds a one-token bias). Per row, from
    the request's own ids: batch mates change nothing."""
    p = req.params
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt_ids) | set(req.output_ids)), dtype=torch.long, device=logits.device)
        seen = seen[seen < logits.numel()]
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and req.output_ids:
        ids = torch.tensor(req.output_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=logits.numel())[:logits.numel()].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.bias_tensors is not None:
        index, values = p.bias_tensors
        logits.index_add_(0, index.to(logits.device), values.to(logits.dtype).to(logits.device))
    return logits


def _min_p(scaled: torch.Tensor, min_p: float) -> torch.Tensor:
    """vLLM's and SGLang's min-p on a temperature-scaled row: a token whose probability is below `min_p` times
    the most likely token's is removed. That ratio is exp(its logit - the top logit) whatever the row's
    normalization, so the test is on logits: no softmax, and exact at min_p=1 (only the top logit and its
    ties stay). Top-k keeps the top logit, so the two filters commute: applying it after top-k is vLLM's
    order (min-p, then top-k and top-p, which renormalizes what is left)."""
    return scaled.masked_fill(scaled < scaled.max() + math.log(min_p), float("-inf"))


GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy, as in vLLM: `logits / t` overflows to inf for tiny `t`."""


def mask_for(req: Request):
    """`req`'s mask for its next token: the result jump-forward already computed for this very
    history (`req.next_allowed`), else a call of the mask function (each history is asked once)."""
    known, req.next_allowed = req.next_allowed, None
    if known is not None and known[0] == len(req.output_ids):
        return known[1]
    pending = req.mask_pending  # asked of the mask worker for this history: its answer, not a second call
    if pending is not None and pending[0] == req.output_ids:
        req.mask_pending = None
        return pending[1].result()
    return req.params.mask(list(req.output_ids))


def forced_token(allowed, vocab: int) -> int | None:
    """The one token a mask result allows, when it allows exactly one that the model has; None otherwise
    (no restriction, several tokens, none, or a mask `sample` would reject: it raises there)."""
    if allowed is None:
        return None
    a = _bools(allowed)
    if a.size > vocab or np.count_nonzero(a) != 1:
        return None
    return int(a.argmax())


def draw_forced(req: Request, token: int, vocab: int) -> None:
    """Consume exactly the random draw `sample` makes when its mask allows only `token`: its
    distribution is then exactly one-hot (softmax of one finite logit among -inf; top-k and top-p keep
    it), and a draw depends on the generator and that input alone. So seeded sampling with
    jump-forward draws the same later tokens as without. Greedy requests draw nothing."""
    if req.params.temperature >= GREEDY_BELOW:
        probs = torch.zeros(vocab, dtype=torch.float32)
        probs[token] = 1.0
        drawn = int(torch.multinomial(probs, 1, generator=req.generator))
        assert drawn == token


def forced_logprob(logits: torch.Tensor, req: Request, token: int) -> TokenLogprob:
    """The logprob entry `sample` would give a forced `token` from this float32 row: of the raw
    distribution, or with `masked_logprobs` of the penalized one masked to `token` alone."""
    p = req.params
    if p.masked_logprobs:
        if _adjusted(p):
            logits = _adjust(logits, req)
        only = torch.zeros(logits.numel(), dtype=torch.bool, device=logits.device)
        only[token] = True
        logits = logits.masked_fill(~only, float("-inf"))
    return token_logprobs(logits[None], [token], p.logprobs)[0]


def sample(logits: torch.Tensor, req: Request, draft: int | None = None) -> tuple[int, TokenLogprob | None]:
    """Pick the next token for `req` from its float32 `logits` row `[vocab]`.

    Penalties and the logit bias first (`_adjust`; at their defaults the logits are untouched, so greedy
    output stays exact), then the mask. Greedy when temperature is below `GREEDY_BELOW` (ties
    go to the lowest id, as in `torch.argmax`); otherwise temperature, then top-k, then min-p (`_min_p`), then
    nucleus (top-p) filtering, then a draw from the request's own seeded generator.
    Logprobs are those of the raw model distribution (before penalties, bias, mask and temperature), or of
    the masked (and adjusted) one with `masked_logprobs`.
    `draft`: a drafted token this row verifies (speculative decoding). Greedy: ignored (the caller compares).
    Sampled: speculative sampling for a draft that proposes one token with certainty: keep `draft` with
    probability p(draft), else draw from p with `draft` removed, renormalized; the token then has exactly
    the distribution p, as without a draft (the random draws differ: seeded requests are never drafted).
    """
    p = req.params
    raw = logits
    if _adjusted(p):
        logits = _adjust(logits, req)
    allowed = mask_for(req) if p.mask is not None else None
    greedy = p.temperature < GREEDY_BELOW
    if allowed is not None and (not greedy or (p.logprobs is not None and p.masked_logprobs)):
        logits, allowed = _apply_mask(logits, allowed), None  # the masked row itself is needed
    if greedy:
        token = _argmax(logits, allowed)
    else:
        scaled = logits / p.temperature
        if 0 < p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))  # ties with the k-th stay in
        if p.min_p > 0:
            scaled = _min_p(scaled, p.min_p)
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p, and always the most likely token
            # (a top_p below float32's resolution would otherwise drop every token)
            drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= p.top_p
            drop[0] = False
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs.cpu()
        if draft is not None:
            probs = probs / probs.sum()  # top-p left it unnormalized (multinomial does not mind; the test does)
        if draft is not None and float(torch.rand(1, generator=req.generator)) < float(probs[draft]):
            token = draft
        else:
            if draft is not None:
                probs[draft] = 0.0  # (p(draft) < 1 here: something else is left to draw)
            token = int(torch.multinomial(probs, 1, generator=req.generator))
    entry = None
    if p.logprobs is not None:
        entry = token_logprobs((logits if p.masked_logprobs else raw)[None], [token], p.logprobs)[0]
    return token, entry


def token_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """For each row of float32 `logits` `[n, vocab]`: the log-softmax value of `targets[row]` and the
    `k` most likely tokens of that row (the raw distribution: no penalty, mask or temperature)."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, torch.tensor(targets, dtype=torch.long, device=logp.device)[:, None])[:, 0].tolist()
    if k == 0:
        return [TokenLogprob(t, lp, {}) for t, lp in zip(targets, chosen)]
    top = torch.topk(logp, k, dim=-1)
    return [TokenLogprob(t, lp, dict(zip(ids, vals)))
            for t, lp, ids, vals in zip(targets, chosen, top.indices.tolist(), top.values.tolist())]
