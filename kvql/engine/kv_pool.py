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
    """`k[layer]` and `v[layer]` are `[kv_heads, num_slots, head_dim]` views into one tensor each."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str):
        if num_slots < 1:
            raise ValueError("a KV pool needs at least one slot")
        shape = (num_layers, kv_heads, num_slots, head_dim)
        # torch.empty: pages are touched only when a slot is written, yet the size is fixed here.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.device = torch.device(device)
        self._free = torch.arange(num_slots, dtype=torch.long, device=self.device)

    @staticmethod
    def slot_bytes(*, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token occupies (K and V, all layers)."""
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def bytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def num_free(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` free slots (a long tensor), or None if fewer than `n` are free."""
        if n > self._free.numel():
            return None
        slots, self._free = self._free[:n], self._free[n:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Return slots to the free list. The caller must own them and stop using them."""
        if slots.numel():
            self._free = torch.cat([self._free, slots.to(self.device)])

    def free_slots(self) -> torch.Tensor:
        """A copy of the free list, for integrity checks."""
        return self._free.clone()
