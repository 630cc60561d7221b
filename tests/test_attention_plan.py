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
    (bucket,) = plan(segs, groups=1, device="cpu").buckets
    assert bucket.rows == 1
    assert bucket.k_len == 100 + 6 * 3  # the prefix once, plus each request's own slots
    # each query sees exactly its own 103 slots
    assert bucket.mask[0, 0].sum(dim=1).tolist() == [103] * 6


def test_unrelated_chunks_stay_separate_rows():
    segs = [seg(list(range(1000 * i, 1000 * i + 7)), list(range(1000 * i + 7, 1000 * i + 50))) for i in range(4)]
    p = plan(segs, groups=2, device="cpu")
    (bucket,) = p.buckets
    assert not p.causal
    assert bucket.rows == 4 and bucket.k_len == 50 and bucket.q_len == 43
    causal = bucket.mask[0, 0, :43]  # first packed head group of row 0
    assert torch.equal(causal, torch.ones(50, 50, dtype=torch.bool).tril()[7:])


def test_prompts_without_past_attend_in_place_in_causal_groups():
    """Adjacent equal-length prompts with no cached past form one causal group; others their own."""
    segs = [seg([], list(range(100 * i, 100 * i + 20))) for i in range(3)] + [seg([], [900, 901])]
    segs += [seg([5, 6], [7])]
    p = plan(segs, groups=2, device="cpu")
    assert [(c.offset, c.rows, c.q_len) for c in p.causal] == [(0, 3, 20), (60, 1, 2)]
    (bucket,) = p.buckets
    assert bucket.out_index.tolist() == [62]


def test_without_merging_each_row_sees_its_own_keys_in_order():
    prefix = list(range(100))
    segs = [seg(prefix + [200 + 10 * i], [300 + i]) for i in range(3)]
    segs.append(seg([7], [8, 9]))  # a chunk: padded into the same bucket, attended alone all the same
    (bucket,) = plan(segs, groups=1, device="cpu", merge=False).buckets
    assert bucket.rows == 4 and bucket.q_len == 2 and bucket.k_len == 102
    assert bucket.exact == [(1, 102)] * 3 + [(2, 3)]  # each row's real queries and keys
    assert bucket.k_slots.view(4, 102)[1].tolist() == prefix + [210, 301]


def test_long_chunk_and_decodes_go_to_different_buckets():
    segs = [seg([1000], list(range(64)))] + [seg(list(range(100 + 10 * i, 105 + 10 * i)), [500 + i]) for i in range(3)]
    buckets = plan(segs, groups=1, device="cpu").buckets
    assert sorted(b.q_len for b in buckets) == [1, 64]
    assert sum(int(b.valid.sum()) for b in buckets) == 64 + 3
