"""KV pool: preallocated key/value storage for every layer, addressed by slot index.

One slot holds the key and value vectors of one token in every layer. The pool is allocated once,
from a byte budget, and never grows: `bytes` never exceeds the budget it was built from.

Invariant: every slot index in `[0, num_slots)` is either in the free list or owned by exactly one
holder (the radix tree or one running request). The pool does not know the holders; the engine's
`check_integrity()` adds them up.
"""

from __future__ import annotations

import torch


class KVPool:
    """`k[layer]` is `[kv_heads, num_slots, head_dim]`, `v[layer]` `[kv_heads, num_slots, v_dim]` (`v_dim`:
    `head_dim` unless given: MLA's cached latent has a value part of its own width), views into one tensor each."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str, v_dim: int | None = None):
        if num_slots < 1:
            raise ValueError("a KV pool needs at least one slot")
        # torch.empty: pages are touched only when a slot is written, yet the size is fixed here.
        self.k = torch.empty((num_layers, kv_heads, num_slots, head_dim), dtype=dtype, device=device)
        self.v = torch.empty((num_layers, kv_heads, num_slots, head_dim if v_dim is None else v_dim), dtype=dtype,
                             device=device)
        self.num_slots = num_slots
        self.device = torch.device(device)
        # the free list, first in first out, as a ring: `_count` slots from `_head` (wrapping). Taking and
        # returning k slots costs O(k), not a copy of the whole list (a 4 GiB pool has ~10^5 slots).
        self._ring = torch.arange(num_slots, dtype=torch.long, device=self.device)
        self._head = 0
        self._count = num_slots

    def split_keys(self, head_dim: int) -> None:
        """A pool of keys alone (`v` zero wide: MLA's absorbed form) seen as keys of `head_dim` and values of the
        rest (MLA's own forward: its latent and its rotary key part apart): views of the same memory, whatever
        the slots hold kept."""
        assert self.v.shape[-1] == 0 and 0 < head_dim < self.k.shape[-1]
        keys = self.k
        self.k, self.v = keys[..., :head_dim], keys[..., head_dim:]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Layer `layer`'s K (and V) of the tokens at `slots` (`[kv_heads, len(slots), dim]` each): the one place
        the torch paths write the pool (the lean forward's compiled step writes the same rows by its C kernel)."""
        self.k[layer].index_copy_(1, slots, k)
        if v is not None:
            self.v[layer].index_copy_(1, slots, v)

    @staticmethod
    def slot_bytes(*, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                   v_dim: int | None = None) -> int:
        """Bytes one token occupies (K and V, all layers)."""
        v_dim = head_dim if v_dim is None else v_dim
        return num_layers * kv_heads * (head_dim + v_dim) * torch.empty((), dtype=dtype).element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes one slot occupies (K and V, all layers)."""
        return (self.k[:, :, 0].numel() + self.v[:, :, 0].numel()) * self.k.element_size()

    @property
    def bytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def num_free(self) -> int:
        return self._count

    def _span(self, start: int, n: int) -> torch.Tensor:
        """A copy of the ring's `n` entries from `start` (wrapping)."""
        end = start + n
        if end <= self.num_slots:
            return self._ring[start:end].clone()
        return torch.cat([self._ring[start:], self._ring[:end - self.num_slots]])

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` free slots (a long tensor: the longest-free first), or None if fewer than `n` are free."""
        if n > self._count:
            return None
        slots = self._span(self._head, n)
        self._head = (self._head + n) % self.num_slots
        self._count -= n
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Return slots to the free list. The caller must own them and stop using them."""
        k = slots.numel()
        if not k:
            return
        assert self._count + k <= self.num_slots, "more slots freed than the pool has: a slot freed twice"
        slots = slots.to(self.device).flatten()
        tail = (self._head + self._count) % self.num_slots
        first = min(k, self.num_slots - tail)
        self._ring[tail:tail + first] = slots[:first]
        self._ring[:k - first] = slots[first:]
        self._count += k

    def free_slots(self) -> torch.Tensor:
        """A copy of the free list (in the order `alloc` takes them), for integrity checks."""
        return self._span(self._head, self._count)
