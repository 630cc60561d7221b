"""Decoders and their options, as LMQL names them: `argmax`, `sample(n, temperature)`, `beam(n)`, ...

`decoding(name, options)` validates a decoder clause (or the keyword arguments of a query call) into
the `Decoding` every run of one call shares.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from ..backends.options import GenerateOptions

DEFAULT_MAX_LEN = 2048

DECODERS = ("argmax", "sample", "beam", "beam_search", "beam_sample", "best_k", "var", "beam_var")
SAMPLING_OPTIONS = ("top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
IGNORED_OPTIONS = ("chunksize", "verbose", "cache", "openai_chunksize", "openai_nonstop", "chunk_timeout",
                   "distribution_batch_size")
"""LMQL options about OpenAI requests, LMQL's own caches, logging and batching: accepted, no effect
(kvql caches every prefix in its engine, batches every request, and asks for tokens one at a time)."""
BEAM_OPTIONS = ("num_beams", "k", "b", "subdecoder", "budget", "kappa", "beta", "gamma", "max_heap_size",
                "top_k_continuations", "alpha", "prune", "inject_stop", "return_first")
"""Options of LMQL's beam-family decoders: `num_beams` / `k` / `b` set the width; the tuning knobs of
best_k / beam_var / var (LMQL's experimental decoders) are accepted and have no effect."""
DECODER_OPTIONS = frozenset({"n", "temperature", "max_len", "seed", "token_healing", *SAMPLING_OPTIONS,
                             *IGNORED_OPTIONS, *BEAM_OPTIONS})


@dataclass
class Decoding:
    """Decoder settings of a run, with LMQL's keyword arguments (see `decoding`).

    `name` is LMQL's decoder; every beam-family decoder (beam, beam_sample, best_k, var, beam_var)
    runs kvql's per-hole beam search of `width` beams (`sampled`: candidates are drawn, not the top
    ones) and gives `n` results."""

    name: str = "argmax"
    n: int = 1
    temperature: float = 1.0
    max_len: int = DEFAULT_MAX_LEN
    seed: int | None = None
    shared: dict = field(default_factory=dict)  # beam searches shared by the n runs of one call
    sampling: dict = field(default_factory=dict)  # top_k, top_p, min_p and the penalties, for the backend
    width: int = 1
    sampled: bool = False
    heal: bool = False  # token_healing=True: every hole is healed, as HEAL(V) heals one (the backend contract's heal option)

    @property
    def beam(self) -> bool:
        return self.name not in ("argmax", "sample")

    @property
    def runs(self) -> int:
        """How many runs (results) one call makes."""
        return 1 if self.name == "argmax" else self.n


def decoding(name: str, opts: dict) -> Decoding:
    """Validate LMQL decoder `name` and its options; ValueError for a bad value or an unknown decoder.
    An option no decoder knows is ignored with a warning (LMQL hands such options to its model backend,
    which ignores those it does not know: `stop=None`, `beams=2` run there unchanged)."""
    unknown = sorted(set(opts) - DECODER_OPTIONS)
    if unknown:
        warnings.warn(f"kvql ignores the option(s) {unknown}: no decoder or model here has them (known: "
                      f"{', '.join(sorted(DECODER_OPTIONS - set(IGNORED_OPTIONS) - set(BEAM_OPTIONS)))}, and "
                      f"LMQL's beam and OpenAI options)", UserWarning, stacklevel=3)
        opts = {k: v for k, v in opts.items() if k in DECODER_OPTIONS}
    if name not in DECODERS:
        raise ValueError(f"unknown decoder {name!r}; use one of {', '.join(DECODERS)}")
    if name == "var" and opts.get("subdecoder", "sample") not in ("sample", "beam"):
        raise ValueError(f"var(subdecoder={opts['subdecoder']!r}) is not supported; use 'sample' or 'beam'")
    width = {"best_k": opts.get("k", 4), "var": opts.get("b", 2)}.get(name, opts.get("num_beams", opts.get("n", 1)))
    default_n = width if name not in ("argmax", "sample") else 1
    n, width = int(opts.get("n", default_n)), int(width)
    if n < 1 or width < 1:
        raise ValueError(f"n and the beam width must be >= 1, got n={n}, width={width}")
    sampling = {k: opts[k] for k in SAMPLING_OPTIONS if opts.get(k) is not None}
    temperature = float(opts.get("temperature", 1.0))
    _check_sampling(temperature, sampling)
    heal = opts.get("token_healing", False)
    if not isinstance(heal, bool):
        raise ValueError(f"token_healing must be True or False, got {heal!r}")
    sampled = name == "beam_sample" or (name == "var" and opts.get("subdecoder", "sample") == "sample")
    return Decoding(name, n, temperature, int(opts.get("max_len", DEFAULT_MAX_LEN)), opts.get("seed"),
                    sampling=sampling, width=width, sampled=sampled, heal=heal)


def _check_sampling(temperature: float, sampling: dict) -> None:
    """ValueError (TypeError for a value of the wrong kind) for a sampling option no backend accepts, naming it:
    the backend contract's own check (`GenerateOptions`), at the query's definition rather than at its first
    hole."""
    GenerateOptions(temperature=temperature, **sampling)
