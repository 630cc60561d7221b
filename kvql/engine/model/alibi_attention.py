"""ALiBi attention on the ragged path: Bloom's and MPT's attention modules through the engine's cache and attention
function.

Bloom's and MPT's attention (ALiBi: each score gains a slope per head times its key's position, no rotary
embedding) does not go through transformers' AttentionInterface: it adds the bias tensor its model builds (from a
2-D mask: Bloom's `alibi`; MPT's `position_bias`) to its scores itself. `prepare(model)` swaps the class of each
such module for a subclass whose forward, given the engine's cache (`PoolCache`, or a probe's `ProbeCache`),
computes the module's q, k and v as its own forward does, writes k and v through the cache's `update`, and calls
the attention function registered with transformers (pool_attention's) with the step's plan and the heads' slopes
(`slopes`: transformers' own, from the family's function that builds its bias), which the paged kernel and the
gather path add to each score; then the module's own output projection (and Bloom's residual). Any other call
(no engine cache: transformers' `generate`, the uncached reference) runs the module's own forward unchanged. A
Bloom module split for tensor-parallel pretraining (`pretraining_tp > 1` with `slow_but_exact`) is not swapped:
the probe then finds its layers outside the engine's attention and the model runs on its own forward. The model's own forward builds its `alibi` tensor and
causal mask from no mask (`takes_no_mask`): both are unused on the ragged path.

Exactness is the load check's (model_runner.ModelRunner.verify): the scores add the same slopes times the same
positions in float32 (Bloom adds them in the model's dtype; MPT's bias is relative to the last key, which
softmax does not see: a row's scores shifted alike).
"""

from __future__ import annotations

import functools

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import class_swap

MARK = "kvql_alibi_of"  # (class_swap.py)


def _forwards() -> dict[type, object]:
    """The attention classes kvql runs on the ragged path -> the forward that does."""
    from transformers.models.bloom import modeling_bloom
    from transformers.models.mpt import modeling_mpt

    return {modeling_bloom.BloomAttention: _bloom_forward, modeling_mpt.MptAttention: _mpt_forward}


def prepare(hf_model) -> bool:
    """Swap every ALiBi attention module of `hf_model` (module doc); whether it has any."""
    forwards = _forwards()
    found = [m for m in hf_model.modules() if (type(m) in forwards and not _tensor_parallel(m))
             or class_swap.original(m, MARK)]
    for module in found:
        if type(module) in forwards:
            class_swap.swap(module, MARK, "Ragged", {"forward": forwards[type(module)]})
    return bool(found)


def _tensor_parallel(module) -> bool:
    """Bloom's output projection computed in slices (its `slow_but_exact` pretraining form), which kvql's forward
    does not reproduce."""
    return getattr(module, "pretraining_tp", 1) > 1 and getattr(module, "slow_but_exact", False)


def restore(hf_model) -> None:
    class_swap.restore(hf_model.modules(), MARK)


def takes_no_mask(hf_model) -> bool:
    """Whether `hf_model` runs swapped ALiBi modules: its forward then gets no attention mask (module doc)."""
    return any(class_swap.original(m, MARK) for m in hf_model.modules())


@functools.cache
def slopes(family: str, heads: int) -> torch.Tensor:
    """ALiBi's slope per head as the family's transformers code computes them (`[heads]` float32): Bloom's, or
    MPT's (its model builds them with the default `alibi_bias_max`)."""
    if family == "bloom":
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        return build_alibi_tensor(torch.ones(1, 2), heads, torch.float32).view(heads, 2)[:, 1].contiguous()
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bias = build_mpt_alibi_tensor(heads, 2).view(heads, 2)  # positions -1, 0
    return (bias[:, 1] - bias[:, 0]).float().contiguous()


def _plan(cache):
    """The step's plan the engine's cache carries (`PoolCache.plan`, a probe's `ProbeCache.probe`), or None."""
    return getattr(cache, "plan", None) or getattr(cache, "probe", None)


def _bloom_forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                   output_attentions=False, **kwargs):
    plan = _plan(layer_past)
    if plan is None:
        return type(self).kvql_alibi_of.forward(self, hidden_states, residual, alibi, attention_mask, layer_past,
                                                use_cache, output_attentions, **kwargs)
    batch, length, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))
    key, value = layer_past.update(key, value, self.layer_idx)
    alibi_slopes = slopes("bloom", self.num_heads).to(query.device)
    out, _ = ALL_ATTENTION_FUNCTIONS["kvql"](self, query, key, value, None, scaling=self.inv_norm_factor,
                                             kvql_plan=plan, alibi_slopes=alibi_slopes)
    output = self.dense(out.reshape(batch, length, -1))
    return torch.nn.functional.dropout(output, p=self.hidden_dropout, training=self.training) + residual, None


def _mpt_forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
    plan = _plan(cache)
    if plan is None:
        return type(self).kvql_alibi_of.forward(self, hidden_states, position_bias, cache, attention_mask, **kwargs)
    batch, length = hidden_states.shape[:2]
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (x.reshape(batch, length, self.n_heads, self.head_dim).transpose(1, 2) for x in qkv.chunk(3, 2))
    key, value = cache.update(key, value, self.layer_idx)
    alibi = None if position_bias is None else slopes("mpt", self.n_heads).to(query.device)
    out, _ = ALL_ATTENTION_FUNCTIONS["kvql"](self, query, key, value, None, scaling=self.softmax_scale,
                                             kvql_plan=plan, alibi_slopes=alibi)
    return self.out_proj(out.reshape(batch, length, -1)), None
