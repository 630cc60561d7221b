"""Mamba2 mixers (Granite 4 hybrids, Nemotron-H, Falcon-H1, Bamba, Zamba2, Mamba2) over a forward's ragged batch: the
mixer's own forward, once for every segment of the batch, its convolution and selective scan by kvql's kernels.

transformers writes these mixers' state work as two module-level functions each family's mixer calls with its cache,
`causal_conv1d_forward(conv1d, x, cache, layer_idx, ...)` and `mamba2_scan_forward(mixer, x, B, C, dt, cache, ...)`
("so that `kernelize` can replace it, e.g. with a runtime that manages the recurrent state itself"). `install` puts a
wrapper in their place in the family's modeling module that, given a `RaggedStates` as the cache, runs kvql's kernels
(kernels/recurrent_step.py: the short convolution, and `ssd_`, the scan's recurrent form) for each segment from its
request's state in place, and hands any other cache to transformers' own function unchanged. So the recurrent
mixer runs as one call over all the batch's rows: its projections, gates, norms and each family's multipliers the
model's own code, batched; only the state work per segment. A segment with no state starts from zeros, as
transformers starts one; the scan runs token by token (the form transformers' own decode steps run; its prompt code
runs the chunked form: the load check, model_runner.ModelRunner.verify, compares both with the model's own forward
and steps, and falls back where they differ). The states a segment's cuts ask for (snapshot marks, drafted tokens)
are copied as the kernels pass them (`RaggedStates.saved`). A state of another kind (a bf16 scan state, a cache
recording its past) raises `Unsupported` before anything is changed: the caller then runs the model's code per
request.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .kernels import recurrent_step
from .mixer_steps import by_pieces, start, takes

_WRAPPED = ("causal_conv1d_forward", "mamba2_scan_forward")
_ORIGINALS: dict = {}  # each wrapper `install` made -> the function it wraps


class Unsupported(Exception):
    """A state the kernels do not take; nothing was changed."""


def _module_of(mixer):
    return sys.modules[getattr(type(mixer), "kvql_mixer_of", type(mixer)).__module__]


def supports(mixer) -> bool:
    """Whether `mixer` is a Mamba2 mixer whose state work goes through the two functions (module doc)."""
    mod = _module_of(mixer)
    return (recurrent_step.available() and all(callable(getattr(mod, f, None)) for f in _WRAPPED)
            and all(isinstance(getattr(mixer, a, None), int) for a in
                    ("num_heads", "head_dim", "n_groups", "ssm_state_size", "layer_idx"))
            and isinstance(getattr(mixer, "conv1d", None), torch.nn.Conv1d)
            and all(isinstance(getattr(mixer, a, None), torch.Tensor) for a in ("A_log", "dt_bias", "D")))


def install(mixer) -> None:
    """The two functions of `mixer`'s modeling module wrapped (module doc); idempotent."""
    mod = _module_of(mixer)
    for name, ours, at in zip(_WRAPPED, ("_conv", "_scan"), (2, 5)):
        original = getattr(mod, name)
        if original not in _ORIGINALS:
            setattr(mod, name, _wrapper(original, ours, at))


def _wrapper(original, ours: str, at: int):
    """`original` where its cache (argument `at`, or `cache=`) is not a `RaggedStates`, else this module's function
    named `ours`."""

    def wrapped(*args, **kwargs):
        cache = kwargs["cache"] if "cache" in kwargs else (args[at] if len(args) > at else None)
        if isinstance(cache, RaggedStates):
            return globals()[ours](*args, **kwargs)
        return original(*args, **kwargs)

    _ORIGINALS[wrapped] = original
    return wrapped


class RaggedStates:
    """The `cache=` of one mixer call over a forward's rows: segment s is `lengths[s]` rows from `starts[s]`,
    continuing the state in `layers[s]` (a transformers linear-attention cache layer, one request's), updated in
    place; after token b for each b in `cuts[s]`, copies of its conv and recurrent states go to `saved[s, b]`."""

    def __init__(self, mixer, layers: list, starts: list[int], lengths: list[int], cuts: list[set[int]]):
        self.layers, self.starts, self.lengths, self.cuts = layers, starts, lengths, cuts
        self.recurrent_shape = (1, mixer.num_heads, mixer.head_dim, mixer.ssm_state_size)
        self.saved: dict[tuple[int, int], list] = {}

    def save(self, s: int, b: int, which: int, state: torch.Tensor) -> None:
        """A copy of segment s's conv (`which` 0) or recurrent (1) state after its token b."""
        self.saved.setdefault((s, b), [None, None])[which] = state.clone()


def _conv(conv1d, hidden_states, cache: RaggedStates, layer_idx, activation=None, state_idx=0, **kwargs):
    """`causal_conv1d_forward` over the segments: `hidden_states [1, channels, rows]`. Checks (and starts) every
    segment's states first: the conv runs before the scan in each mixer."""
    mixer_shape = cache.recurrent_shape
    channels, taps = conv1d.in_channels, conv1d.kernel_size[0]
    x = hidden_states[0].transpose(0, 1).contiguous()
    if (state_idx != 0 or activation not in ("silu", None) or conv1d.weight.dtype != x.dtype
            or not all(takes(layer, taps, x.dtype, mixer_shape) for layer in cache.layers)):
        raise Unsupported
    for layer in cache.layers:
        start(layer, channels, taps, x.dtype, mixer_shape)
    out = by_pieces(cache.starts, cache.lengths, cache.cuts, cache.layers, (x,),
                    lambda rows, segs, active: recurrent_step.short_conv_(
                        rows, segs, [cache.layers[s].conv_states[0] for s in active], conv1d.weight.squeeze(1),
                        conv1d.bias, silu=activation == "silu"),
                    lambda s, b: cache.save(s, b, 0, cache.layers[s].conv_states[0]))
    return out.transpose(0, 1)[None]


def _scan(mixer, hidden_states, B, C, dt, cache: RaggedStates, **kwargs):
    """`mamba2_scan_forward` over the segments: the scan's output with its D skip, `[1, rows, heads * head_dim]`."""
    rows = hidden_states.shape[1]
    heads, head_dim, groups, n = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    dt = F.softplus(dt[0] + mixer.dt_bias.to(dt.dtype))  # as transformers' scan: in the model's dtype
    low, high = getattr(mixer, "time_step_limit", (0.0, float("inf")))
    if (low, high) != (0.0, float("inf")):
        dt = torch.clamp(dt, min=low, max=high)
    x = hidden_states[0].reshape(rows, heads, head_dim).float().contiguous()
    b = B[0].reshape(rows, groups, n).float().contiguous()
    c = C[0].reshape(rows, groups, n).float().contiguous()
    dt = dt.float().contiguous()
    a = (-torch.exp(mixer.A_log.float())).contiguous()
    d = mixer.D.float().contiguous()
    out = by_pieces(cache.starts, cache.lengths, cache.cuts, None, (x, b, c, dt),  # (counted by the conv)
                    lambda xs, bs, cs, dts, segs, active: recurrent_step.ssd_(
                        xs, bs, cs, dts, a, d, segs, [cache.layers[s].recurrent_states[0] for s in active]),
                    lambda s, t: cache.save(s, t, 1, cache.layers[s].recurrent_states[0]))
    return out.reshape(1, rows, heads * head_dim).to(hidden_states.dtype)
