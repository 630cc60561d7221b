"""Batch-invariant linear layers: a token's output row never depends on the rows computed beside it.

Greedy decoding with the cache must give what the request alone gives. In float32 the last-bit
differences between GEMM shapes never flip a greedy token in the tests; in bfloat16 they do. Measured
on this project's CPU (torch 2.13, oneDNN bf16 GEMM, 1 and 2 threads): a bf16 `linear` computes each
output row exactly as it computes that row alone whenever the reduction (`in_features`) is at most
1,024, for every batch size tried (1 to 1,024 rows); above that (SmolLM2's MLP `down_proj`, 1,536) a
few rows in each batch round differently (2 of 24, 62 of 700), depending on their place in the batch.

`split_reductions(model)` therefore computes every `nn.Linear` with `in_features > MAX_REDUCTION` as the
sum of GEMMs over equal slices of at most `MAX_REDUCTION` inputs (views of the weight: no copy), each
batch-invariant, added in a fixed order, so the sum is too. It changes the layer's rounding (a few
ULPs, the same whatever the batch), not its arithmetic. Cost measured on SmolLM2's `down_proj`, one
thread: +16% for 24 rows, +1% for 512 (about +3% of a decode step). The model runner applies it on a
CPU in reduced precision only; CUDA and float32 keep the model's own layers.
"""

from __future__ import annotations

import math
import types

import torch

MAX_REDUCTION = 1024


def _split_forward(self, x: torch.Tensor) -> torch.Tensor:
    out = None
    for a in range(0, self.in_features, self.kvql_slice):
        b = a + self.kvql_slice
        y = torch.nn.functional.linear(x[..., a:b], self.weight[:, a:b])
        out = y if out is None else out + y
    return out if self.bias is None else out + self.bias


def split_reductions(model: torch.nn.Module, max_reduction: int = MAX_REDUCTION) -> int:
    """Make every `nn.Linear` of `model` with more than `max_reduction` inputs batch-invariant (module
    doc); returns how many layers were changed. Idempotent."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.in_features > max_reduction \
                and getattr(module, "kvql_slice", None) is None:
            parts = math.ceil(module.in_features / max_reduction)
            module.kvql_slice = math.ceil(module.in_features / parts)
            module.forward = types.MethodType(_split_forward, module)
            changed += 1
    return changed
