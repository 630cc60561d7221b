"""Attention plan: which new tokens attend to which pool slots, grouped so the batch runs in few kernels.

The batch's new tokens are one flat row `[T]`. Each segment (one request's new tokens) attends to
its own slots: its cached prefix then its new tokens, causally. Segments that share a long cached
prefix are merged into one *cluster* whose keys are the union of their slots (the shared prefix is
then gathered and multiplied once for all of them); unrelated segments stay separate, so their cost is
that of per-request attention. Clusters of similar query length are padded into one *bucket*: one
batched SDPA call per bucket and layer.

Cost model for merging (in query-key pairs): a cluster costs `queries * keys`, plus `COPY_COST` per
gathered key slot. A segment joins the cluster before it (segments sorted by their slots, so sharers
are adjacent) when the merged cost is at most the cost of keeping both apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COPY_COST = 4  # gathering one slot's K and V costs about as much as this many query-key dot products


@dataclass
class Bucket:
    """`rows` clusters padded to `q_len` queries and `k_len` keys."""

    rows: int
    q_len: int
    k_len: int
    q_index: torch.Tensor   # [rows * q_len] positions in the flat token row (padding repeats a valid one)
    k_slots: torch.Tensor   # [rows * k_len] pool slots (padding repeats a slot of the same row)
    mask: torch.Tensor      # [rows, 1, groups * q_len, k_len] bool, query heads of a KV head packed
    valid: torch.Tensor     # [rows * q_len] bool: which padded query rows are real
    out_index: torch.Tensor  # [n_valid] flat token positions of the real query rows


def _shared_len(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n


def plan(segments, groups: int, device) -> list[Bucket]:
    """Build the buckets for `segments` (objects with `token_ids`, `past_slots`, `new_slots`)."""
    offsets, t = [], 0
    for s in segments:
        offsets.append(t)
        t += len(s.token_ids)
    slots = [torch.cat([s.past_slots, s.new_slots]) for s in segments]
    order = sorted(range(len(segments)), key=lambda i: slots[i][:64].tolist())

    clusters: list[list[int]] = []
    shared = q = apart = 0
    for i in order:
        n_q, n_k = len(segments[i].token_ids), slots[i].numel()
        alone = n_q * n_k + COPY_COST * n_k
        if clusters:
            s = min(shared, _shared_len(slots[clusters[-1][0]], slots[i]))
            members = clusters[-1] + [i]
            union = s + sum(slots[j].numel() - s for j in members)
            if (q + n_q) * union + COPY_COST * union <= apart + alone:
                clusters[-1].append(i)
                shared, q, apart = s, q + n_q, apart + alone
                continue
        clusters.append([i])
        shared, q, apart = n_k, n_q, alone

    rows = []
    for members in clusters:
        keys = torch.unique(torch.cat([slots[i] for i in members]))
        q_index = torch.cat([torch.arange(offsets[i], offsets[i] + len(segments[i].token_ids)) for i in members])
        mask = torch.zeros(q_index.numel(), keys.numel(), dtype=torch.bool, device=device)
        r = 0
        for i in members:
            n, past = len(segments[i].token_ids), segments[i].past_slots.numel()
            cols = torch.searchsorted(keys, slots[i])
            mask[r:r + n, cols] = (torch.arange(past + n, device=device)[None, :]
                                   <= torch.arange(past, past + n, device=device)[:, None])
            r += n
        rows.append((q_index, keys, mask))
    rows.sort(key=lambda row: row[0].numel())

    buckets, start = [], 0
    while start < len(rows):
        end = start + 1
        first_q = rows[start][0].numel()
        while end < len(rows) and rows[end][0].numel() <= max(2 * first_q, first_q + 8):
            end += 1
        buckets.append(_pad(rows[start:end], groups, device))
        start = end
    return buckets


def _pad(rows, groups: int, device) -> Bucket:
    n_rows = len(rows)
    q_len = max(r[0].numel() for r in rows)
    k_len = max(r[1].numel() for r in rows)
    q_index = torch.zeros(n_rows, q_len, dtype=torch.long)
    valid = torch.zeros(n_rows, q_len, dtype=torch.bool)
    k_slots = torch.empty(n_rows, k_len, dtype=torch.long, device=device)
    mask = torch.zeros(n_rows, q_len, k_len, dtype=torch.bool, device=device)
    for r, (qi, keys, m) in enumerate(rows):
        nq, nk = qi.numel(), keys.numel()
        q_index[r, :nq], q_index[r, nq:] = qi, qi[0]
        valid[r, :nq] = True
        k_slots[r, :nk], k_slots[r, nk:] = keys, keys[0]  # a written slot: never NaN garbage
        mask[r, :nq, :nk] = m
        mask[r, nq:, 0] = True  # padded queries see one key, so no row is fully masked
    q_index, valid = q_index.flatten(), valid.flatten()
    return Bucket(n_rows, q_len, k_len, q_index.to(device), k_slots.flatten(),
                  mask.repeat(1, groups, 1)[:, None], valid.to(device), q_index[valid].to(device))
