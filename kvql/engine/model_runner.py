"""Model runner: one forward of a Hugging Face causal LM over a ragged batch, KV in the pool.

All new tokens of all requests are flattened to one `[1, T]` row with per-request `position_ids`.
A `PoolCache` passed as the model's `cache=` writes each layer's new K/V into the pool slots given
for those tokens and returns the K/V of the *union* of slots the batch reads (`[1, kv_heads, U, D]`);
a boolean mask `[T, U]` lets each token see exactly its own request's slots up to itself. A prefix
shared by many requests is therefore read once per layer, not once per request, and is never copied.
Cached keys were rotated at their own positions when computed (RoPE), so any slot order is valid.

Works for any model on the standard transformers path: attention modules that call
`cache.update(k, v, layer_idx, ...)` and then the registered attention function (Llama, Qwen2,
Mistral, SmolLM2, ...).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .kv_pool import KVPool

ATTENTION = "kvql"


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, kvql_packed=False, **kwargs):
    """SDPA over pool K/V; query heads that share a KV head are packed into one row block (no K/V copy).

    Without `kvql_packed` (the model used by plain transformers code) it is ordinary SDPA.
    """
    if not kvql_packed:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    _, heads, t, d = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(1, kv_heads, (heads // kv_heads) * t, d)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(1, heads, t, value.shape[-1]).transpose(1, 2), None


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


class PoolCache:
    """The `cache=` object for one forward: writes new K/V into the pool, returns the batch's K/V."""

    def __init__(self, pool: KVPool, write_slots: torch.Tensor, read_slots: torch.Tensor):
        self.pool, self.write_slots, self.read_slots = pool, write_slots, read_slots

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.pool.k[layer_idx], self.pool.v[layer_idx]
        k.index_copy_(1, self.write_slots, key_states[0])
        v.index_copy_(1, self.write_slots, value_states[0])
        return k.index_select(1, self.read_slots)[None], v.index_select(1, self.read_slots)[None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


@dataclass
class Segment:
    """New tokens of one request in a batch: `token_ids` at positions `start ...`, written to `new_slots`;
    `past_slots` hold the KV of its positions `0 .. start-1`."""

    token_ids: list[int]
    start: int
    past_slots: torch.Tensor
    new_slots: torch.Tensor
    needs_logits: bool


class ModelRunner:
    def __init__(self, hf_model, pool: KVPool):
        self.model = hf_model
        self.pool = pool
        self.device = pool.device
        config = hf_model.config
        self.groups = config.num_attention_heads // config.num_key_value_heads
        hf_model.set_attn_implementation(ATTENTION)
        self.forward_seconds = 0.0
        self.forward_tokens = 0

    @torch.inference_mode()
    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """Run the batch; return float32 logits `[n, vocab]` for the segments with `needs_logits`, in order."""
        dev = self.device
        ids, pos, rows = [], [], []
        t = 0
        for s in segments:
            n = len(s.token_ids)
            ids.extend(s.token_ids)
            pos.append(torch.arange(s.start, s.start + n))
            if s.needs_logits:
                rows.append(t + n - 1)
            t += n
        write = torch.cat([s.new_slots for s in segments])
        read = torch.unique(torch.cat([torch.cat([s.past_slots, s.new_slots]) for s in segments]))
        mask = torch.zeros(t, read.numel(), dtype=torch.bool, device=dev)
        t = 0
        for s in segments:
            n, past = len(s.token_ids), s.past_slots.numel()
            cols = torch.searchsorted(read, torch.cat([s.past_slots, s.new_slots]))
            q = torch.arange(past, past + n, device=dev)[:, None]
            k = torch.arange(past + n, device=dev)[None, :]
            mask[t:t + n, cols] = k <= q
            t += n
        packed = mask.repeat(self.groups, 1)[None, None]
        started = time.perf_counter()
        out = self.model(
            input_ids=torch.tensor([ids], device=dev),
            position_ids=torch.cat(pos).to(dev)[None],
            attention_mask=packed,
            cache=PoolCache(self.pool, write, read),
            logits_to_keep=torch.tensor(rows, dtype=torch.long, device=dev),
            kvql_packed=True,
        )
        logits = out.logits[0].float()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.forward_seconds += time.perf_counter() - started
        self.forward_tokens += len(ids)
        return logits
