"""Scoring: the log-probability a model assigns to given continuations of a prompt."""

from __future__ import annotations

import asyncio

import torch


def forcing_mask(token_ids: list[int], vocab: int):
    """A mask that allows exactly `token_ids`, one per step."""
    def mask(generated: list[int]) -> torch.Tensor:
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[token_ids[len(generated)]] = True
        return allowed
    return mask


async def score_continuations(model, prompt_ids: list[int], continuations: list[str]):
    """-> (sum of token log-probabilities of each continuation after the prompt, the completions).

    All continuations are scored concurrently (one batch in the engine; the prompt is computed once).
    Log-probabilities are those of the raw model distribution.
    """
    tok = model.tokenizer

    async def one(text: str):
        ids = tok.encode(text, add_special_tokens=False)
        if not ids:
            return 0.0, None
        (c,) = await model.agenerate([prompt_ids], max_tokens=len(ids), mask=forcing_mask(ids, model.vocab_size),
                                     logprobs=0, ignore_eos=True)
        return sum(e.logprob for e in c.logprobs), c

    results = await asyncio.gather(*(one(t) for t in continuations))
    return [lp for lp, _ in results], [c for _, c in results if c is not None]
