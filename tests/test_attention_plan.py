"""The attention plan merges segments that share a cached prefix and keeps unrelated ones apart."""

from __future__ import annotations

import torch

from kvql.engine.model.attention_plan import plan
from kvql.engine.model.model_runner import Segment


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
    segs.append(seg([7], [8, 9]))  # a chunk: other query count, so its own bucket
    decodes, chunk = plan(segs, groups=1, device="cpu", merge=False).buckets
    assert (decodes.rows, decodes.q_len, decodes.k_len) == (3, 1, 128)  # 102 keys padded to a KEY_BLOCK multiple
    assert (chunk.rows, chunk.q_len, chunk.k_len) == (1, 2, 64)
    row = decodes.k_slots.view(3, 128)[1]
    assert row[:102].tolist() == prefix + [210, 301] and set(row[102:].tolist()) == {0}  # padding: a written slot
    assert decodes.mask[1, 0, 0].tolist() == [True] * 102 + [False] * 26
    assert chunk.mask[0, 0].tolist() == [[True, True, False] + [False] * 61, [True] * 3 + [False] * 61]


def test_without_merging_a_rows_shape_depends_on_its_own_keys_only():
    """Batch-invariant buckets: a request's padded key length is set by its own key count, whatever its batch
    mates (a longer mate goes to another bucket instead of padding it further)."""
    short, long_ = seg(list(range(30)), [100]), seg(list(range(200, 300)), [400])
    alone = plan([short], groups=1, device="cpu", merge=False).buckets
    together = plan([short, long_], groups=1, device="cpu", merge=False).buckets
    assert [(b.rows, b.k_len) for b in alone] == [(1, 64)]
    assert [(b.rows, b.k_len) for b in together] == [(1, 64), (1, 128)]


def test_long_chunk_and_decodes_go_to_different_buckets():
    segs = [seg([1000], list(range(64)))] + [seg(list(range(100 + 10 * i, 105 + 10 * i)), [500 + i]) for i in range(3)]
    buckets = plan(segs, groups=1, device="cpu").buckets
    assert sorted(b.q_len for b in buckets) == [1, 64]
    assert sum(int(b.valid.sum()) for b in buckets) == 64 + 3


def test_paged_plan_sends_every_segment_to_the_kernel_with_its_own_slots():
    segs = [seg([], [0, 1, 2]), seg(list(range(10, 50)), [50]), seg([60, 61], [62, 63, 64, 65])]
    p = plan(segs, groups=3, device="cpu", paged=True)
    assert not p.causal and not p.buckets
    k = p.paged
    assert k.count == 3
    assert k.q_start.tolist() == [0, 3, 4] and k.q_len.tolist() == [3, 1, 4]
    assert k.n_keys.tolist() == [3, 41, 6] and k.key_start.tolist() == [0, 3, 44]
    assert k.slots.tolist() == [0, 1, 2] + list(range(10, 51)) + [60, 61, 62, 63, 64, 65]
    assert k.max_keys == 41
