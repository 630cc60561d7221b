"""Scoring: the log-probability a model assigns to given continuations of a prompt, and LMQL's
`ScoringResult` view of those scores."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backends import base  # the contract only: no torch, no engine


def normalized(logps: list[float]) -> list[float]:
    """Log-probabilities normalized over the given values (a log-softmax)."""
    return [float(x) for x in _log_softmax(np.array(logps, dtype=np.float64))]


@dataclass
class ScoredSequence:
    """One scored sequence: prompt + continuation token ids, and a log-probability per token
    (0.0 for the prompt's tokens, which are given, not scored: as in LMQL)."""

    input_ids: np.ndarray
    logprobs: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


class _Logprobs(list):
    """The summed log-probability of each value (a list, kvql's `ScoreResult.logprobs`); calling it,
    `logprobs(agg="sum")`, is LMQL's `ScoringResult.logprobs()`: the scores normalized over the values."""

    def __init__(self, values, result: "ScoringResult"):
        super().__init__(values)
        self._result = result

    def __call__(self, agg: str = "sum", **kwargs) -> np.ndarray:
        return _log_softmax(self._result.scores(agg, **kwargs))


def _log_softmax(a: np.ndarray) -> np.ndarray:
    top = np.max(a)
    if not np.isfinite(top):
        return np.where(a == top, 0.0, -np.inf)
    return a - (top + np.log(np.sum(np.exp(a - top))))


class ScoringResult:
    """Scores of continuations `values` of `prompt` (LMQL's `lmql.ScoringResult`).

    - `seqs`: per value, the `ScoredSequence` of prompt + value tokens;
    - `full_token_scores`: per value, the log-probability of every token of that sequence (prompt tokens 0.0);
    - `token_scores`: per value, the log-probabilities of the value's own tokens (numpy arrays);
    - `scores(agg)`: one score per value: `"sum"` of its sequence's log-probabilities, `"mean"` over the
      sequence's tokens, or `"normalized"`: the sum divided by `len(seq) ** alpha` (alpha=0.7);
    - `logprobs(agg)` / `probs(agg)`: those scores normalized (log-softmax / softmax) over the values;
    - `argmax(agg)`: the value with the highest score.

    kvql's own names still work: `values` (the continuations), and `logprobs` read as a list is the
    summed log-probability of each value (`scores("sum")`, unnormalized).
    """

    def __init__(self, prompt: str, values: list, prompt_ids: list[int], value_ids: list[list[int]],
                 value_logprobs: list[list[float]], model_identifier: str = "model"):
        self.prompt = prompt
        self.continuations = values
        self.num_value_tokens = [len(ids) for ids in value_ids]
        self.model_identifier = model_identifier
        self.seqs = [ScoredSequence(np.array(prompt_ids + ids, dtype=np.int64),
                                    np.array([0.0] * len(prompt_ids) + list(lps), dtype=np.float64))
                     for ids, lps in zip(value_ids, value_logprobs)]
        self.logprobs = _Logprobs([float(s.logprobs.sum()) for s in self.seqs], self)

    @property
    def values(self) -> list:
        return self.continuations

    @property
    def full_token_scores(self) -> list[np.ndarray]:
        return [s.logprobs for s in self.seqs]

    @property
    def token_scores(self) -> list[np.ndarray]:
        return [s.logprobs[len(s) - n:] for s, n in zip(self.seqs, self.num_value_tokens)]

    def scores(self, agg: str = "sum", **kwargs) -> np.ndarray:
        sums = np.array([s.logprobs.sum() for s in self.seqs])
        if agg == "sum":
            return sums
        if agg == "mean":
            return np.array([s.logprobs.mean() for s in self.seqs])
        if agg.startswith("normalized"):
            lengths = np.array([len(s) for s in self.seqs])
            return sums / lengths ** kwargs.get("alpha", 0.7)
        raise ValueError(f"invalid aggregation {agg!r}: use 'sum', 'mean' or 'normalized'")

    def probs(self, agg: str = "sum", **kwargs) -> np.ndarray:
        return np.exp(self.logprobs(agg, **kwargs))

    def argmax(self, agg: str = "sum", **kwargs):
        return self.continuations[int(self.scores(agg, **kwargs).argmax())]

    def __str__(self) -> str:
        rows = [f"-{repr(c)[1:-1]}: {s}" for c, s in zip(self.continuations, self.scores("sum"))]
        return "\n".join([f"lmql.ScoringResult(model='{self.model_identifier}')"] + rows)

    __repr__ = __str__


async def score(model, prompt: str, values) -> ScoringResult:
    """Score each of `values` (a string or a list; each converted with `str`) as a continuation of
    `prompt` on any backend with the `TOKEN_IDS` and `SCORE` capabilities. The prompt is tokenized as a
    model input (special tokens such as a BOS included), each value on its own, and the value's ids
    appended (as LMQL does)."""
    model.require(base.TOKEN_IDS, "score() (it scores token sequences)")
    model.require(base.SCORE, "score() (prompt log-probabilities)")
    values = [values] if isinstance(values, str) else list(values)
    if not values:
        raise ValueError("score() needs at least one value")
    tok = model.tokenizer
    prompt_ids = tok(prompt, add_special_tokens=True).input_ids  # LMQL's score adds no BOS (measured)
    value_ids = [tok.encode(str(v), add_special_tokens=False) for v in values]
    per_token, _ = await model.ascore(prompt_ids, value_ids)
    return ScoringResult(prompt, values, prompt_ids, value_ids, per_token, getattr(model, "name", "model"))
