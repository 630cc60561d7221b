"""kvql's one-token steps of recurrent mixers, for every decoding request of a batch in one call, each on its own
state in place: Qwen3.5's Gated DeltaNet and LFM2's short convolution.

The ragged path steps a hybrid's recurrent mixers by the model's own code, the states of a step's requests stacked
into one tensor and split again (recurrent_mixers.Step). For a mixer of a form this file knows (`step_of`) the
step runs here instead, with kvql's kernels (kernels/recurrent_step.py): the module's own projections over the
rows, its short convolution (and delta rule) on each request's own conv (and recurrent) state where it lies (no
stacking; each state read and written once), the module's own norm and output projection. The arithmetic around
the kernels is the model's own (the same ops in the same dtypes as its torch path: for Gated DeltaNet l2-normed
float32 q and k, q divided by the root of its width, `beta = sigmoid(b)`, `g = -exp(A_log) * softplus(a +
dt_bias)`; for LFM2 `C * conv(B * x)`); the kernels' sums run in their own order, which the load check
(model_runner.ModelRunner.verify) compares with the model's own steps, falling back to them where they differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import recurrent_step

_DELTA = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj")


def step_of(module):
    """The step this file computes `module` with (`step(module, x, layers)`), or None: a Gated DeltaNet mixer of
    Qwen3.5's form, or a short convolution of LFM2's (where the kernels run here)."""
    if not recurrent_step.available():
        return None
    if (all(hasattr(module, p) for p in _DELTA) and getattr(module, "activation", None) in ("silu", None)
            and all(isinstance(getattr(module, a, None), int) for a in
                    ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim"))
            and isinstance(module.conv1d, torch.nn.Conv1d)):
        return gated_delta
    conv = getattr(module, "conv", None)
    proj = getattr(module, "in_proj", None)
    if (isinstance(conv, torch.nn.Conv1d) and conv.groups == conv.in_channels == conv.out_channels
            and isinstance(proj, torch.nn.Module) and getattr(proj, "out_features", None) == 3 * conv.in_channels
            and hasattr(module, "out_proj") and _original(module).__name__.startswith("Lfm2")):
        return short_conv
    return None


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # transformers' (FLA's) l2norm


def _original(module) -> type:
    """`module`'s class before the ragged path swapped it (recurrent_mixers.py)."""
    return getattr(type(module), "kvql_mixer_of", type(module))


def _states(layers: list, recurrent: bool) -> tuple[list, list] | None:
    """The conv (and recurrent) states of `layers` (transformers linear-attention cache layers, one request's
    each), or None where some layer holds none the kernels take."""
    if not all(layer.has_previous_state.get(0) and not getattr(layer, "record_past", False) for layer in layers):
        return None
    conv = [layer.conv_states[0] for layer in layers]
    rec = [layer.recurrent_states[0] for layer in layers] if recurrent else []
    if not all(isinstance(s, torch.Tensor) and s.is_contiguous() for s in conv + rec):
        return None
    return conv, rec


def _counted(layers: list) -> None:
    for layer in layers:  # the token count transformers' own step keeps (a new tensor: never shared)
        layer.cumulative_length_linear = layer.cumulative_length_linear + 1


def short_conv(module, x: torch.Tensor, layers: list) -> torch.Tensor | None:
    """LFM2's short convolution (`step`)."""
    states = _states(layers, recurrent=False)
    if states is None or states[0][0].dtype != x.dtype or module.conv.weight.dtype != x.dtype:
        return None
    b, c, h = module.in_proj(x).chunk(3, dim=-1)
    conv = recurrent_step.short_conv_((b * h).contiguous(), states[0], module.conv.weight.squeeze(1),
                                      module.conv.bias, silu=False)
    _counted(layers)
    return module.out_proj(c * conv)


def gated_delta(module, x: torch.Tensor, layers: list) -> torch.Tensor | None:
    """Qwen3.5's Gated DeltaNet (`step`)."""
    states = _states(layers, recurrent=True)
    if states is None:
        return None
    conv, recurrent = states
    rows, dtype = x.shape[0], x.dtype
    hk, hv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    if conv[0].dtype != dtype or recurrent[0].dtype != torch.float32 or module.conv1d.weight.dtype != dtype:
        return None
    mixed = recurrent_step.short_conv_(module.in_proj_qkv(x), conv, module.conv1d.weight.squeeze(1),
                                      module.conv1d.bias, module.activation == "silu")
    z = module.in_proj_z(x)
    b, a = module.in_proj_b(x), module.in_proj_a(x)
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = _l2norm(query.reshape(rows, hk, dk).float())
    query = query / (dk ** 0.5)
    key = _l2norm(key.reshape(rows, hk, dk).float())
    beta = b.sigmoid().float()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    core = recurrent_step.gated_delta_(query.contiguous(), key.contiguous(),
                                       value.reshape(rows, hv, dv).float().contiguous(), g.float().contiguous(),
                                       beta.contiguous(), recurrent)
    _counted(layers)
    out = module.norm(core.to(dtype).reshape(-1, dv), z.reshape(-1, dv)).reshape(rows, -1)
    return module.out_proj(out)


def step(module, x: torch.Tensor, layers: list) -> torch.Tensor | None:
    """`module`'s output for the rows `x [rows, hidden]`, one token each, row r continuing the state in `layers[r]`
    (a transformers linear-attention cache layer, one request's), which is updated in place; None where `module`
    has no step here or some layer does not hold a state the kernels take (then the caller steps with the model's
    own code)."""
    of = step_of(module)
    return None if of is None else of(module, x, layers)
