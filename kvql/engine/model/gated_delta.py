"""Gated DeltaNet's one-token step (Qwen3.5's mixer) for every decoding request of a batch in one call, each on its
own state in place.

The ragged path steps a hybrid's recurrent mixers by the model's own code, the states of a step's requests stacked
into one tensor and split again (recurrent_mixers.Step). For a Gated DeltaNet mixer of Qwen3.5's form (`supports`)
`step` computes the same step with kvql's kernels instead (kernels/recurrent_step.py): the module's own projections
over the rows, its short convolution and delta rule on each request's own conv and recurrent state where it lies
(no stacking; each state read and written once), the module's own gated norm and output projection. The
arithmetic around the kernels is the model's own (the same ops in the same dtypes as its torch path: l2-normed
float32 q and k, q divided by the root of its width, `beta = sigmoid(b)`, `g = -exp(A_log) * softplus(a + dt_bias)`);
the kernels' sums run in their own order, which the load check compares with the model's own steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import recurrent_step

_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj")


def supports(module) -> bool:
    """Whether `module` is a Gated DeltaNet mixer of Qwen3.5's form that `step` computes (and the kernels run
    here)."""
    return (all(hasattr(module, p) for p in _PARTS) and getattr(module, "activation", None) in ("silu", None)
            and all(isinstance(getattr(module, a, None), int) for a in
                    ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim"))
            and isinstance(module.conv1d, torch.nn.Conv1d) and recurrent_step.available())


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # transformers' (FLA's) l2norm


def step(module, x: torch.Tensor, layers: list) -> torch.Tensor | None:
    """`module`'s output for the rows `x [rows, hidden]`, one token each, row r continuing the state in `layers[r]`
    (a transformers linear-attention cache layer, one request's), which is updated in place; None where some layer
    does not hold a state the kernels take (then the caller steps with the model's own code)."""
    if not all(layer.has_previous_state.get(0) and not getattr(layer, "record_past", False) for layer in layers):
        return None
    conv = [layer.conv_states[0] for layer in layers]
    recurrent = [layer.recurrent_states[0] for layer in layers]
    if not all(isinstance(s, torch.Tensor) and s.is_contiguous() for s in conv + recurrent):
        return None
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
    for layer in layers:  # the token count transformers' own step keeps (a new tensor: never shared)
        layer.cumulative_length_linear = layer.cumulative_length_linear + 1
    out = module.norm(core.to(dtype).reshape(-1, dv), z.reshape(-1, dv)).reshape(rows, -1)
    return module.out_proj(out)
