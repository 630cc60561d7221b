"""kvql's own computation of recurrent mixers over a forward's ragged batch: Qwen3.5's and Qwen3-Next's Gated
DeltaNet and LFM2's short convolution, every segment of the batch (a decode step, a prompt's chunk, a draft) in one
call per layer, each continuing its own state in place.

The ragged path runs a hybrid's recurrent mixers by the model's own code otherwise: a prompt chunk alone (the
chunked algorithm, dozens of small ops), the one-token steps of several requests with their states stacked into one
tensor and split again (recurrent_mixers.Step). For a mixer of a form this file knows (`form`), `run` computes it
instead: the module's own projections once over all the rows, its short convolution (and delta rule) with kvql's
kernels (kernels/recurrent_step.py), each segment token after token from its own state where it lies (a fresh
state: zeros, as transformers starts one), then the module's own norm and output projection once over all the rows.
The arithmetic around the kernels is the model's own (the same ops in the same dtypes as its torch path: for
Gated DeltaNet l2-normed float32 q and k, q divided by the root of its width, `beta = sigmoid(b)`, `g = -exp(A_log)
* softplus(a + dt_bias)`; for LFM2 `C * conv(B * x)`); the kernels run the recurrent form (the model's own
generate-time step) where the model's prompt code runs its chunked form: the load check
(model_runner.ModelRunner.verify) compares both ways with the model's own forward and steps, and falls back to the
model's code where they differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import recurrent_step

_DELTA = ("conv1d", "A_log", "dt_bias", "norm", "out_proj")
_SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # Qwen3.5's projections
_JOINT = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")  # Qwen3-Next's


def _original(module) -> type:
    """`module`'s class before the ragged path swapped it (recurrent_mixers.py)."""
    return getattr(type(module), "kvql_mixer_of", type(module))


def form(module) -> str | None:
    """"gated_delta" (a Gated DeltaNet mixer of Qwen3.5's or Qwen3-Next's form), "short_conv" (LFM2's short
    convolution), or None: what `run` computes `module` as (where the kernels run here)."""
    if not recurrent_step.available():
        return None
    if (all(hasattr(module, p) for p in _DELTA) and getattr(module, "activation", None) in ("silu", None)
            and all(isinstance(getattr(module, a, None), int) for a in
                    ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim"))
            and isinstance(module.conv1d, torch.nn.Conv1d)
            and (all(hasattr(module, p) for p in _SPLIT) or all(hasattr(module, p) for p in _JOINT))):
        return "gated_delta"
    conv, proj = getattr(module, "conv", None), getattr(module, "in_proj", None)
    if (isinstance(conv, torch.nn.Conv1d) and conv.groups == conv.in_channels == conv.out_channels
            and isinstance(proj, torch.nn.Module) and getattr(proj, "out_features", None) == 3 * conv.in_channels
            and hasattr(module, "out_proj") and _original(module).__name__.startswith("Lfm2")):
        return "short_conv"
    return None


def takes(layer, taps: int, dtype: torch.dtype, recurrent: tuple | None) -> bool:
    """Whether `layer` (a transformers linear-attention cache layer, one request's) holds a conv state of `taps` in
    `dtype` (and a float32 recurrent state of shape `recurrent`) the kernels take, or none yet (`start` starts it)."""
    if getattr(layer, "record_past", False):
        return False
    if not layer.has_previous_state.get(0):
        return not layer.is_conv_states_initialized.get(0)
    state = layer.conv_states[0]
    if not (isinstance(state, torch.Tensor) and state.is_contiguous() and state.dtype == dtype
            and state.shape[-1] == taps):
        return False
    if recurrent is not None:
        rec = layer.recurrent_states[0]
        return (isinstance(rec, torch.Tensor) and rec.is_contiguous() and rec.dtype == torch.float32
                and tuple(rec.shape) == recurrent)
    return True


def start(layer, channels: int, taps: int, dtype: torch.dtype, recurrent: tuple | None) -> None:
    """A layer with no state yet gets one at zeros, as transformers starts one (its conv state zero-padded)."""
    if layer.has_previous_state.get(0):
        return
    layer.lazy_initialization(conv_states=torch.zeros(1, channels, taps, dtype=dtype),
                              recurrent_states=None if recurrent is None else torch.zeros(recurrent),
                              conv_kernel_size=taps)
    layer.has_previous_state[0] = True


def run(module, kind: str, x: torch.Tensor, starts: list[int], lengths: list[int], layers: list,
        cuts: list[set[int]], on_cut) -> torch.Tensor | None:
    """`module`'s output (of `form` `kind`) for the rows `x [rows, hidden]`: segment s is rows `starts[s] ...`
    (`lengths[s]` tokens) continuing the state in `layers[s]` (a transformers linear-attention cache layer, one
    request's; not started: from zeros), which is updated in place; after token `b` of segment s for each b in
    `cuts[s]` (0 < b < its length), `on_cut(s, b)` (the caller copies the state there). None, touching nothing,
    where some layer holds a state the kernels do not take (then the caller runs the model's own code)."""
    conv = module.conv1d if kind == "gated_delta" else module.conv
    taps, recurrent = conv.kernel_size[0], None
    if kind == "gated_delta":
        recurrent = (1, module.num_v_heads, module.head_k_dim, module.head_v_dim)
    if conv.weight.dtype != x.dtype or not all(takes(layer, taps, x.dtype, recurrent) for layer in layers):
        return None
    for layer in layers:
        start(layer, conv.in_channels, taps, x.dtype, recurrent)
    weight, bias = conv.weight.squeeze(1), conv.bias
    if kind == "gated_delta":
        mixed, z, b, a = _projections(module, x)
        g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
        core = by_pieces(starts, lengths, cuts, layers, (mixed, b.sigmoid().float(), g),
                         lambda m, be, gg, segs, active: _gated_delta(module, m, be, gg, segs,
                                                                      [layers[s] for s in active], weight, bias),
                         on_cut)
        dv = module.head_v_dim
        core = module.norm(core.to(x.dtype).reshape(-1, dv), z.reshape(-1, dv)).reshape(x.shape[0], -1)
    else:
        b, c, h = module.in_proj(x).chunk(3, dim=-1)
        core = by_pieces(starts, lengths, cuts, layers, ((b * h).contiguous(), c),
                         lambda bh, cc, segs, active: cc * recurrent_step.short_conv_(
                             bh, segs, [layers[s].conv_states[0] for s in active], weight, bias, silu=False),
                         on_cut)
    return module.out_proj(core)


def _projections(module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A Gated DeltaNet's input projections of the rows `x`: (q, k and v concatenated, z, b, a), by Qwen3.5's
    separate layers or Qwen3-Next's joint ones (the module's own ordering of their outputs)."""
    if hasattr(module, "in_proj_qkv"):
        return module.in_proj_qkv(x), module.in_proj_z(x), module.in_proj_b(x), module.in_proj_a(x)
    rows = x.shape[0]
    q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x)[None], module.in_proj_ba(x)[None])
    return torch.cat([t.reshape(rows, -1) for t in (q, k, v)], dim=-1), z[0], b[0], a[0]


def _gated_delta(module, mixed, beta, g, segs, layers, weight, bias) -> torch.Tensor:
    rows = mixed.shape[0]
    hk, hv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    mixed = recurrent_step.short_conv_(mixed, segs, [s.conv_states[0] for s in layers], weight, bias,
                                       module.activation == "silu")
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = _l2norm(query.reshape(rows, hk, dk).float())
    query = query / (dk ** 0.5)
    key = _l2norm(key.reshape(rows, hk, dk).float())
    value = value.reshape(rows, hv, dv).float().contiguous()
    return recurrent_step.gated_delta_(query.contiguous(), key.contiguous(), value, g.contiguous(), beta.contiguous(),
                                       segs, [s.recurrent_states[0] for s in layers])


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # transformers' (FLA's) l2norm


def by_pieces(starts: list[int], lengths: list[int], cuts: list[set[int]], layers: list | None, inputs: tuple,
              kernel, cut) -> torch.Tensor:
    """The segments' tokens through `kernel(*inputs' rows, segs, active)` (a kernel over `recurrent_step.Segments`
    `segs` of those rows, continuing the states of the segments `active`), piece by piece between the cut points;
    `layers` (segment s's cache layer `layers[s]`; None: counted elsewhere): each one's token count kept as
    transformers' own code keeps it (a new tensor: a count is never shared between requests); after the piece that
    ends before token b of segment s, for each b in `cuts[s]`, `cut(s, b)` (the caller copies the state there).
    Returns the kernel's outputs for every row of `inputs`, in their order."""
    out = None
    for rows, segs, active, end in _pieces(starts, lengths, cuts):
        y = kernel(*(t if rows is None else t.index_select(0, rows) for t in inputs), segs, active)
        if rows is None:
            out = y
        else:
            if out is None:
                out = y.new_empty((inputs[0].shape[0], *y.shape[1:]))
            out.index_copy_(0, rows, y)
        for s, n in zip(active, segs.n_tok.tolist()):
            if layers is not None:
                layers[s].cumulative_length_linear = layers[s].cumulative_length_linear + n
            if end in cuts[s]:
                cut(s, end)
    return out


def _pieces(starts: list[int], lengths: list[int], cuts: list[set[int]]):
    """The segments' tokens in pieces between the cut points: (the rows of `x` the piece takes, or None for all of
    them; their `recurrent_step.Segments` over those rows; the segments it continues; the token it ends before)."""
    last = max(lengths, default=0)
    bounds = sorted({b for marks in cuts for b in marks if 0 < b < last} | {last})
    if len(bounds) == 1:  # no cuts: every row, in place
        yield None, recurrent_step.Segments(starts, lengths), list(range(len(lengths))), last
        return
    a = 0
    for b in bounds:
        active = [s for s, n in enumerate(lengths) if n > a]
        spans = [(starts[s] + a, min(b, lengths[s]) - a) for s in active]
        rows = torch.cat([torch.arange(r, r + n) for r, n in spans])
        row0 = [0]
        for _, n in spans[:-1]:
            row0.append(row0[-1] + n)
        yield rows, recurrent_step.Segments(row0, [n for _, n in spans]), active, b
        a = b
