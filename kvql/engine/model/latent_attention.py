"""Multi-head latent attention (MLA: DeepSeek V2 / V3, Kimi, GLM-4 MoE Lite, MiniCPM3, Mistral 4, LongCat, ...) on
the ragged path, in its absorbed form.

An MLA layer caches, per token, one latent `c` (`kv_lora_rank` wide, normed) and one rotary key part `r`
(`qk_rope_head_dim`), both shared by every head; its own forward expands them after `cache.update` (`expand_kv`:
`kv_b_proj` makes each head's key `[W_k c, r]` and value `W_v c`) and attends over the expansion. The expansion
costs `heads` times the latent's width per cached token at every step, and cannot read the pool in place. The
inference form (DeepSeek-V2's paper) moves the up-projections to the query and the output instead: with
`W_k`/`W_v` the head's rows of `kv_b_proj`,

    q_h . [W_k c, r] = [W_k^T q_nope_h, q_rope_h] . [c, r]      and      sum_t p_t W_v c_t = W_v sum_t p_t c_t,

so the layer is an MQA (`heads` query heads over one KV head) whose key is the cached `[c, r]` and whose value
is its first `kv_lora_rank` dims, `c`. The engine's pool holds `[c, r]` once per token as the layer's keys and no
values (`Layer.latent`; its V is zero wide), and the paged kernel and the gather path attend with the keys as
values (output `[c-part, r-part]`; the `r` part is dropped before `W_v`).

`prepare(model)` swaps each MLA module's class (any module with `expand_kv` and a bias-free `kv_b_proj`, as every
transformers 5.x MLA family writes it) for a subclass whose `expand_kv`, given the pool's latent (the engine's
caches hand `(latent, None)` back from `update` for a latent layer), hands that latent on as keys and values;
the engine's attention function (pool_attention) then wraps its work in `absorb_query` / `expand_output` for such
a module. Any other call (a transformers cache: `generate`, the uncached reference) runs the module's own
`expand_kv` unchanged. The module's own forward computes everything else (its projections, norms, rotary form,
query scaling), so each family's details stay its own.

Exactness: the same products summed in another order (fp32 agrees to rounding; the load check,
model_runner.ModelRunner.verify, compares with the model's own forward and falls back to it where it differs).
"""

from __future__ import annotations

import weakref

import torch

from . import class_swap

MARK = "kvql_latent_of"  # (class_swap.py)
_DEQUANTIZED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_mla(module) -> bool:
    proj = getattr(module, "kv_b_proj", None)
    return (callable(getattr(module, "expand_kv", None)) and isinstance(proj, torch.nn.Module)
            and getattr(proj, "bias", None) is None
            and all(isinstance(getattr(module, a, None), int) for a in
                    ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "layer_idx")))


def prepare(hf_model) -> frozenset[int]:
    """Swap every MLA module of `hf_model` (module doc); the `layer_idx` of each (empty: the model has none)."""
    layers = set()
    for module in hf_model.modules():
        if not is_latent(module) and _is_mla(module):
            class_swap.swap(module, MARK, "Absorbed", {"expand_kv": _expand_kv})
        if is_latent(module):
            layers.add(module.layer_idx)
    return frozenset(layers)


def restore(hf_model) -> None:
    class_swap.restore(hf_model.modules(), MARK)


def is_latent(module) -> bool:
    """Whether `module` is a swapped MLA module (its attention runs in the absorbed form)."""
    return class_swap.original(module, MARK) is not None


def _expand_kv(self, kv_nope, k_rot):
    if k_rot is None:  # the engine's latent `[c, r]` (module doc): keys and values both
        return kv_nope, kv_nope
    return type(self).kvql_latent_of.expand_kv(self, kv_nope, k_rot)


def latent(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
    """What a latent layer caches per token: `[c, r]` (`[batch, 1, tokens, kv_lora_rank + qk_rope_head_dim]`)."""
    return torch.cat([kv_nope, k_rot], dim=-1)


def _weight(proj) -> torch.Tensor:
    """`proj`'s weight: its own, or a quantized layer's (`quantized.QuantizedLinear`) dequantized once."""
    w = getattr(proj, "weight", None)
    if isinstance(w, torch.Tensor):
        return w
    if proj not in _DEQUANTIZED:
        _DEQUANTIZED[proj] = proj.rows(torch.arange(proj.out_features), torch.float32)
    return _DEQUANTIZED[proj]


def _up(module) -> tuple[torch.Tensor, torch.Tensor]:
    """`(W_k, W_v)`: `kv_b_proj`'s rows per head, `[heads, qk_nope_head_dim, rank]` and `[heads, v_head_dim,
    rank]` (views of its weight)."""
    w = _weight(module.kv_b_proj)
    per_head = w.view(-1, module.qk_nope_head_dim + module.v_head_dim, module.kv_lora_rank)
    return per_head[:, :module.qk_nope_head_dim], per_head[:, module.qk_nope_head_dim:]


def absorb_query(module, query: torch.Tensor) -> torch.Tensor:
    """`query [batch, heads, tokens, nope + rope]` (the module's, scaled as it scales it) -> `[batch, heads,
    tokens, rank + rope]`: its nope part through each head's `W_k^T`, its rotary part as it is."""
    w_k, _ = _up(module)
    nope, rope = query.split([module.qk_nope_head_dim, query.shape[-1] - module.qk_nope_head_dim], dim=-1)
    return torch.cat([torch.matmul(nope, w_k.to(query.dtype)), rope], dim=-1)


def expand_output(module, out: torch.Tensor) -> torch.Tensor:
    """`out [batch, tokens, heads, rank + rope]` (attention with the keys as values) -> `[batch, tokens, heads,
    v_head_dim]`: its latent part through each head's `W_v`, its rotary part dropped."""
    _, w_v = _up(module)
    c = out[..., :module.kv_lora_rank].transpose(1, 2)  # [batch, heads, tokens, rank]
    return torch.matmul(c, w_v.transpose(1, 2).to(out.dtype)).transpose(1, 2)
