"""The attention of a forward through the pool: `PoolCache`, passed as the model's `cache=`, writes each layer's new
K/V into the pool slots given for those tokens; the attention function registered as `ATTENTION` then runs the
batch's `attention_plan` (model_runner.py's module doc: the paged kernel on a CPU, gather + SDPA elsewhere), with
a layer's window, soft-cap, sinks, ALiBi slopes and MLA's absorbed form applied on every path. A call without a
`kvql_plan` (the model's own uses of the function, as in `generate`) runs transformers' own attention."""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .attention_plan import Bucket, Causal, Plan, in_span
from . import admission, latent_attention
from .kernels import paged_attention

ATTENTION = "kvql"


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, kvql_plan=None,
               sliding_window=None, softcap=None, s_aux=None, alibi_slopes=None, **kwargs):
    """Attention over pool K/V following `kvql_plan`, with the layer's own `scaling`, `sliding_window`, `softcap`
    and attention sinks `s_aux` (gpt-oss: a logit per query head in each softmax's denominator; the keywords
    transformers' attention modules pass), and ALiBi's `alibi_slopes` (`[heads]`: each score gains its head's
    slope times its key's position; passed by kvql's own attention modules, alibi_attention.py); an MLA module's
    in its absorbed form (latent_attention.py: `key` and `value` are then the pool's latent); the model's own
    attention when called by ordinary transformers code (no plan), so the same model object still works with
    `generate`."""
    if kvql_plan is None:
        return _plain(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap,
                      {**kwargs, **({} if s_aux is None else {"s_aux": s_aux})})
    if latent_attention.is_latent(module):
        kwargs["latent"] = module.kv_lora_rank
        out, _ = _attend(module, latent_attention.absorb_query(module, query), key, value, scaling, kvql_plan,
                         sliding_window, softcap, s_aux, alibi_slopes, kwargs)
        return latent_attention.expand_output(module, out), None
    return _attend(module, query, key, value, scaling, kvql_plan, sliding_window, softcap, s_aux, alibi_slopes,
                   kwargs)


def _attend(module, query, key, value, scaling, kvql_plan, sliding_window, softcap, s_aux, alibi_slopes, kwargs):
    """`_attention` with a plan: `[1, tokens, heads, value width]`."""
    if isinstance(kvql_plan, admission.Probe):
        admission.record(kvql_plan, query, key, value, {"sliding_window": sliding_window, "softcap": softcap,
                                                        "s_aux": s_aux, "alibi": alibi_slopes, **kwargs})
        t = query.shape[2]
        causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
        sinks = None if s_aux is None else s_aux.view(-1, 1, 1)
        out = _eager(query, key, value, causal, scaling, softcap, query.shape[1] // key.shape[1], sinks)
        return out.transpose(1, 2).contiguous(), None  # [batch, tokens, heads, head_dim], as transformers returns it
    _, heads, t, d = query.shape
    chunk = kvql_plan.chunks.get(module.layer_idx) if kvql_plan.chunks else None
    k_pool, v_pool = key[0], value[0]  # [kv_heads, slots, head_dim]
    kv_heads = k_pool.shape[0]
    g = heads // kv_heads
    out = query.new_empty(t, heads, v_pool.shape[-1])
    slopes = None if alibi_slopes is None else alibi_slopes.float().contiguous()
    if kvql_plan.paged is not None:  # a paged plan has nothing else: every segment read in place
        paged_attention.attend(query[0], k_pool, v_pool, out, kvql_plan.paged, scaling or d ** -0.5,
                               sliding_window, softcap, None if s_aux is None else s_aux.float().contiguous(),
                               chunk, slopes)
        return out[None], None
    c: Causal
    for c in kvql_plan.causal:  # no past: causal attention over the K/V just written (slots in a row: in place)
        span = slice(c.offset, c.offset + c.rows * c.q_len)
        q = query[0, :, span].unflatten(1, (c.rows, c.q_len)).transpose(0, 1)
        k, v = (x[:, c.slots].unflatten(1, (c.rows, c.q_len)).transpose(0, 1) for x in (k_pool, v_pool))
        if sliding_window or chunk or softcap or s_aux is not None or slopes is not None:
            i = torch.arange(c.q_len, device=query.device)
            mask = (i[None, :] <= i[:, None]) & in_span(i[:, None], i[None, :], sliding_window, chunk)
            bias = None if slopes is None else slopes.view(-1, 1, 1) * i  # the keys' positions: 0 ...
            o = _eager(q, k, v, mask, scaling, softcap, g, None if s_aux is None else s_aux.view(-1, 1, 1), bias)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                                                 enable_gqa=g > 1)
        out[span].unflatten(0, (c.rows, c.q_len)).copy_(o.transpose(1, 2))
    if not kvql_plan.buckets:
        return out[None], None
    qv = query[0].view(kv_heads, g, t, d)
    b: Bucket
    for b in kvql_plan.buckets:
        # query heads sharing a KV head are packed along the query axis: K/V are never repeated
        q = qv[:, :, b.q_index].view(kv_heads, g, b.rows, b.q_len, d).permute(2, 0, 1, 3, 4)
        q = q.reshape(b.rows, kv_heads, g * b.q_len, d)
        k, v = (x.view(kv_heads, b.rows, b.k_len, -1).transpose(0, 1) for x in _gather(b, k_pool, v_pool))
        mask = b.span_mask(sliding_window, chunk, g)
        if softcap or s_aux is not None or slopes is not None:  # per query head: per row of the packed query axis
            per_row = lambda x: x.view(kv_heads, g, 1).repeat_interleave(b.q_len, 1).view(kv_heads, g * b.q_len, 1)
            sinks = None if s_aux is None else per_row(s_aux)
            bias = None if slopes is None else per_row(slopes) * b.k_pos.view(b.rows, 1, 1, b.k_len)
            o = _eager(q, k, v, mask, scaling, softcap, 1, sinks, bias)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        o = o.view(b.rows, kv_heads, g, b.q_len, -1).permute(0, 3, 1, 2, 4).reshape(b.rows * b.q_len, heads, -1)
        out.index_copy_(0, b.out_index, o if b.out_index.numel() == o.shape[0] else o[b.valid])
    return out[None], None


def _eager(q, k, v, mask, scaling, softcap, groups: int, sinks=None, bias=None):
    """Attention written out (for what SDPA cannot do: soft-capped scores, sinks, ALiBi): `q [.., heads, Q, d]` over
    `k`/`v [.., heads / groups, K, d]`, boolean `mask` broadcast to `[.., Q, K]`; softmax in float32. `sinks`
    (broadcast to `[.., heads, Q, 1]`): one more logit in each row's softmax, whose weight goes to no value
    (gpt-oss's attention sinks, as its eager attention computes them); `bias` (broadcast to the scores, float32):
    added to the scaled scores (ALiBi's)."""
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scaling or q.shape[-1] ** -0.5)
    if bias is not None:
        scores = (scores.float() + bias).to(scores.dtype)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    scores = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(weights.to(q.dtype), v)


def _plain(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap, kwargs):
    """A transformers call with no plan: SDPA as transformers' `sdpa` implementation, or, where SDPA cannot
    compute the layer (soft-capped scores, sinks), the model's own eager attention with the mask made additive."""
    if softcap is None and "s_aux" not in kwargs:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, **kwargs)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    if attention_mask is None:  # transformers' SDPA mask is None where SDPA's own causal flag does it
        q, k = query.shape[2], key.shape[2]
        i, j = torch.arange(k - q, k, device=query.device)[:, None], torch.arange(k, device=query.device)[None]
        attention_mask = ((j <= i) & (j > i - (sliding_window or k)))[None, None]
    if attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                 sliding_window=sliding_window, softcap=softcap, **kwargs)


def _gather(b: Bucket, k_pool, v_pool):
    """The bucket's K and V slots from the pool (`[kv_heads, slots, head_dim]`): `[kv_heads, rows * k_len,
    head_dim]` each. With several threads, one index_select over dim 0 of the pool viewed `[kv_heads *
    slots, head_dim]` (its row copies run in parallel; over dim 1 they do not: 0.28 vs 0.46 ms for a
    batch-24 decode bucket in fp32 at 2 threads); with one thread over dim 1, slightly faster there."""
    if torch.get_num_threads() == 1:
        return k_pool.index_select(1, b.k_slots), v_pool.index_select(1, b.k_slots)
    kv_heads, slots, _ = k_pool.shape
    if b.k_flat is None:  # once per step: every layer's pool has the same shape
        b.k_flat = (b.k_slots[None] + slots * torch.arange(kv_heads, device=b.k_slots.device)[:, None]).flatten()
    return (k_pool.view(kv_heads * slots, -1).index_select(0, b.k_flat).view(kv_heads, -1, k_pool.shape[-1]),
            v_pool.view(kv_heads * slots, -1).index_select(0, b.k_flat).view(kv_heads, -1, v_pool.shape[-1]))


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # a 4-D mask is passed through as is: skips mask building


class PoolCache:
    """The `cache=` object for one forward: writes new K/V into the pool, hands the layer's pool on. A hybrid's:
    `kv_layers` (the model's layer index of each pool layer, `Geometry.kv_layers`) and `recurrent`, the step's
    recurrent work (recurrent_mixers.Step), which its mixers read."""

    def __init__(self, pool, write_slots: torch.Tensor, plan: Plan, kv_layers: tuple[int, ...] | None = None,
                 recurrent=None, latent: frozenset[int] = frozenset()):
        self.pool, self.write_slots, self.plan, self.recurrent = pool, write_slots, plan, recurrent
        self.pool_layer = None if kv_layers is None else {i: j for j, i in enumerate(kv_layers)}
        self.latent = latent

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Writes the layer's new K/V to their slots; returns the layer's pool (`[1, kv_heads, slots, dim]` each).
        A `latent` layer (MLA's, latent_attention.py) is given its latent and rotary key part and caches them as
        one key; it gets `(its pool's keys, None)` back. (`latent`: pool layer indices.)"""
        if self.pool_layer is not None:
            layer_idx = self.pool_layer[layer_idx]
        if layer_idx in self.latent:
            key_states = latent_attention.latent(key_states, value_states)
            self.pool.write(layer_idx, self.write_slots, key_states[0])
            return self.pool.k[layer_idx][None], None
        self.pool.write(layer_idx, self.write_slots, key_states[0], value_states[0])
        return self.pool.k[layer_idx][None], self.pool.v[layer_idx][None]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(the new tokens, no past): what a model asks to build its masks and ALiBi tensor with no mask given
        (Bloom's, alibi_attention.py), which the engine's attention does not read."""
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0  # as `get_mask_sizes`

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0. A batch's rows have no one past length; the engine passes position_ids and its own mask, so a
        forward has no use for it (some, Falcon's, ask all the same). A model whose layers ask (with their
        layer index) runs on its own forward (admission.probe); one whose output depends on it otherwise fails
        `verify`, whose second forward runs over cached tokens."""
        return 0
