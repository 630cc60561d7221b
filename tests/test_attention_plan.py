"""The attention plan merges segments that share a cached prefix and keeps unrelated ones apart."""

from __future__ import annotations

import torch

from kvql.engine.attention_plan import plan
from kvql.engine.model_runner import Segment


def seg(past, new):
    past, new = torch.tensor(past, dtype=torch.long), torch.tensor(new, dtype=torch.long)
    return Segment(list(range(new.numel())), past.numel(), past, new, True)


def test_decodes_sharing_a_long_prefix_form_one_row_over_the_union():
    prefix = list(range(100))
    segs = [seg(prefix + [200 + 10 * i, 201 + 10 * i], [300 + i]) for i in range(6)]
    (bucket,) = plan(segs, groups=1, device="cpu")
    assert bucket.rows == 1
    assert bucket.k_len == 100 + 6 * 3  # the prefix once, plus each request's own slots
    # each query sees exactly its own 103 slots
    assert bucket.mask[0, 0].sum(dim=1).tolist() == [103] * 6


def test_unrelated_prefills_stay_separate_rows():
    segs = [seg([], list(range(1000 * i, 1000 * i + 50))) for i in range(4)]
    (bucket,) = plan(segs, groups=2, device="cpu")
    assert bucket.rows == 4 and bucket.k_len == 50 and bucket.q_len == 50
    causal = bucket.mask[0, 0, :50]  # first packed head group of row 0
    assert torch.equal(causal, torch.ones(50, 50, dtype=torch.bool).tril())


def test_long_prefill_and_decodes_go_to_different_buckets():
    segs = [seg([], list(range(64)))] + [seg(list(range(100 + 10 * i, 105 + 10 * i)), [500 + i]) for i in range(3)]
    buckets = plan(segs, groups=1, device="cpu")
    assert sorted(b.q_len for b in buckets) == [1, 64]
    assert sum(int(b.valid.sum()) for b in buckets) == 64 + 3
