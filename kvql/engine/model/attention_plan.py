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

Segments without a past (a prompt computed from its first token) need no past: their keys are exactly
their own new tokens, which the forward has just written to the pool. They form *causal groups*: runs of
adjacent such segments of equal length, attended over the K/V at their slots with a causal SDPA (no mask,
one call per group and layer; read in place, nothing gathered, where the slots are consecutive, as a fresh
pool gives them; by index otherwise).

Paged (`paged=True`: on a CPU where `paged_attention` builds, the runner's default there): every
segment is read in place by the paged kernel, one task per (segment, query block, KV head): nothing
gathered, no bucket, no padding, no cluster. Its arithmetic for a token depends only on that token's
query and keys, so a request rounds alike in any batch and however its prompt was split into chunks or
served from the cache, in fp32 and bf16 alike, also with long shared prefixes, where the aligned SDPA path
below is not exact (fuzz of batched against alone: docs/benchmarks.md, Design measurements). On long
prompts it keeps pace with SDPA (paged_attention's doc); the clusters, buckets and causal groups below are
the plan without it (CUDA, no C compiler, `KVQL_PAGED_ATTENTION=0`).

Batch invariance without the kernel (`merge=False`, CUDA or no C compiler): each request attends over
exactly its own keys, in its own order, padded (masked) to a length set by its own key count only: the
next multiple of `KEY_BLOCK`. Requests with the same number of queries and the same padded key length
share one bucket (one SDPA call); no request is padded further for a batch mate. Prompts without a past
take the same path (gathered from the pool, masked), not the in-place causal groups, so a prompt computed
whole and the same prompt computed as a chunk after a cached prefix round alike in nearly all cases.
Why this holds, and where it stops (the CPU SDPA kernel in bf16, torch 2.13): each batch row of a call
equals that row alone at the same shapes, and a row's keys padded to any multiple of `KEY_BLOCK` (checked
up to 768) give the same output, where a decode row padded to an unaligned batch mate's length often
rounds differently. With long shared prefixes (a few hundred tokens) some prompts still round differently
batched than alone: the SDPA kernel splits keys into blocks of 512 and queries into blocks by their count.
Measured: docs/benchmarks.md, Design measurements. Merging into clusters interleaves
other requests' keys among a request's own and changes the order of the reductions: cheaper for shared
prefixes, not invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import paged_attention

COPY_COST = 4  # gathering one slot's K and V costs about as much as this many query-key dot products
KEY_BLOCK = 64  # batch-invariant mode: a request's keys are padded to a multiple of this (module doc)


@dataclass
class Causal:
    """`rows` adjacent segments of `q_len` new tokens each and no past, from flat position `offset`; `slots`: the
    pool slots their K/V are written to, in order (a `slice` where they are consecutive: read in place)."""

    offset: int
    rows: int
    q_len: int
    slots: slice | torch.Tensor | None = None


@dataclass
class Plan:
    causal: list[Causal]
    buckets: list[Bucket]
    paged: paged_attention.Segments | None = None  # segments read in place by the paged kernel
    chunks: dict[int, int] | None = None  # a chunked attention's chunk by the model's layer index (`layer_idx`)


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
    q_pos: torch.Tensor     # [rows, q_len] each query's position in its sequence
    k_pos: torch.Tensor     # [rows, k_len] each key's position (a slot holds one position in every sequence)
    k_flat: torch.Tensor | None = None  # k_slots per KV head in the pool viewed [kv_heads * slots] (the runner's)
    _spanned: dict | None = None

    def span_mask(self, window: int | None, chunk: int | None, groups: int) -> torch.Tensor:
        """`mask`, and for a sliding window or chunked attention also each query's span (`in_span`; built once
        per step)."""
        if not (window or chunk):
            return self.mask
        if self._spanned is None:
            self._spanned = {}
        if (window, chunk) not in self._spanned:
            near = in_span(self.q_pos[:, :, None], self.k_pos[:, None, :], window, chunk)  # [rows, q_len, k_len]
            self._spanned[window, chunk] = self.mask & near.repeat(1, groups, 1)[:, None]
        return self._spanned[window, chunk]


def in_span(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, chunk: int | None) -> torch.Tensor:
    """Whether a key at `k_pos` (no later than the query) is in the span of a query at `q_pos` (broadcast): its
    last `window` positions (a sliding window), or its own chunk of `chunk` positions (chunked attention), or
    any (neither)."""
    if chunk:
        return k_pos // chunk == q_pos // chunk
    if window:
        return k_pos > q_pos - window
    return torch.ones(torch.broadcast_shapes(q_pos.shape, k_pos.shape), dtype=torch.bool, device=q_pos.device)


def _shared_len(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n


def plan(segments, groups: int, device, merge: bool = True, in_place: bool | None = None,
         paged: bool = False, chunks: dict[int, int] | None = None) -> Plan:
    """Build the plan for `segments` (objects with `token_ids`, `past_slots`, `new_slots`); `merge`:
    clusters of segments sharing a prefix (False: batch-invariant, see the module doc); `in_place`:
    causal groups for segments without a past (False: they too gather from the pool, in buckets;
    default: as `merge`); `paged`: every segment is read in place by the paged kernel instead (module
    doc; `merge` and `in_place` then do not matter); `chunks`: `Plan.chunks`."""
    offsets, t = [], 0
    for s in segments:
        offsets.append(t)
        t += len(s.token_ids)
    if paged:
        return Plan([], [], _paged(segments, offsets), chunks)
    in_place = merge if in_place is None else in_place
    causal: list[Causal] = []
    members: list[list] = []
    rest = []
    for i, s in enumerate(segments):
        n, t = len(s.token_ids), offsets[i]
        if s.past_slots.numel() or not in_place:
            rest.append(i)
        elif merge and causal and causal[-1].q_len == n and causal[-1].offset + causal[-1].rows * n == t:
            causal[-1].rows += 1
            members[-1].append(s.new_slots)
        else:
            causal.append(Causal(t, 1, n))
            members.append([s.new_slots])
    for c, slots in zip(causal, members):
        c.slots = _in_place(torch.cat(slots), device)
    return Plan(causal, _buckets(segments, rest, offsets, groups, device, merge), None, chunks)


def _in_place(slots: torch.Tensor, device) -> slice | torch.Tensor:
    """`slots` as a slice where they are consecutive (the pool read in place, no copy), else as an index."""
    cpu = slots.cpu()
    if len(cpu):
        first = int(cpu[0])
        if torch.equal(cpu, torch.arange(first, first + len(cpu), dtype=cpu.dtype)):
            return slice(first, first + len(cpu))
    return slots.to(device=device, dtype=torch.long)


def _paged(segments, offsets: list[int]) -> paged_attention.Segments | None:
    if not segments:
        return None
    n_new = [len(s.token_ids) for s in segments]
    n_keys = [s.past_slots.numel() + n for s, n in zip(segments, n_new)]
    key_start = [0]
    for n in n_keys[:-1]:
        key_start.append(key_start[-1] + n)
    slots = torch.cat([x for s in segments for x in (s.past_slots, s.new_slots)])
    return paged_attention.Segments(offsets, n_new, key_start, n_keys, slots)


def _clusters(segments, order: list[int], slots: dict, merge: bool) -> list[list[int]]:
    """Runs of `order` attended together: a segment joins the run before it (`merge`) where one gather and
    multiply over the run's key union costs no more than each apart (`COPY_COST` per key gathered)."""
    clusters: list[list[int]] = []
    shared = q = apart = 0
    for i in order:
        n_q, n_k = len(segments[i].token_ids), slots[i].numel()
        alone = n_q * n_k + COPY_COST * n_k
        if clusters and merge:
            s = min(shared, _shared_len(slots[clusters[-1][0]], slots[i]))
            members = clusters[-1] + [i]
            union = s + sum(slots[j].numel() - s for j in members)
            if (q + n_q) * union + COPY_COST * union <= apart + alone:
                clusters[-1].append(i)
                shared, q, apart = s, q + n_q, apart + alone
                continue
        clusters.append([i])
        shared, q, apart = n_k, n_q, alone
    return clusters


def _buckets(segments, indices: list[int], offsets: list[int], groups: int, device, merge: bool) -> list[Bucket]:
    slots = {i: torch.cat([segments[i].past_slots, segments[i].new_slots]) for i in indices}
    order = sorted(indices, key=lambda i: slots[i][:64].tolist()) if merge else indices

    clusters = _clusters(segments, order, slots, merge)
    rows = []
    for members in clusters:
        if len(members) == 1:  # its own keys in its own order
            (i,) = members
            n = len(segments[i].token_ids)
            keys, past = slots[i], segments[i].past_slots.numel()
            mask = (torch.arange(past + n, device=device)[None, :]
                    <= torch.arange(past, past + n, device=device)[:, None])
            rows.append((torch.arange(offsets[i], offsets[i] + n), keys, mask, torch.arange(past, past + n),
                         torch.arange(past + n)))
            continue
        keys = torch.unique(torch.cat([slots[i] for i in members]))
        q_index = torch.cat([torch.arange(offsets[i], offsets[i] + len(segments[i].token_ids)) for i in members])
        mask = torch.zeros(q_index.numel(), keys.numel(), dtype=torch.bool, device=device)
        q_pos, k_pos = [], torch.zeros(keys.numel(), dtype=torch.long)
        r = 0
        for i in members:
            n, past = len(segments[i].token_ids), segments[i].past_slots.numel()
            cols = torch.searchsorted(keys, slots[i])
            mask[r:r + n, cols] = (torch.arange(past + n, device=device)[None, :]
                                   <= torch.arange(past, past + n, device=device)[:, None])
            k_pos[cols.cpu()] = torch.arange(past + n)
            q_pos.append(torch.arange(past, past + n))
            r += n
        rows.append((q_index, keys, mask, torch.cat(q_pos), k_pos))
    if not merge:  # batch-invariant: shapes from each request's own counts only (module doc)
        aligned: dict[tuple[int, int], list] = {}
        for row in rows:
            aligned.setdefault((row[0].numel(), -(-row[1].numel() // KEY_BLOCK) * KEY_BLOCK), []).append(row)
        return [_pad(same, groups, device, k_len) for (_, k_len), same in sorted(aligned.items())]
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


def _pad(rows, groups: int, device, k_len: int | None = None) -> Bucket:
    """One bucket of `rows`, padded to their most queries and to `k_len` keys (default: their most)."""
    n_rows = len(rows)
    q_len = max(r[0].numel() for r in rows)
    k_len = k_len or max(r[1].numel() for r in rows)
    q_index = torch.zeros(n_rows, q_len, dtype=torch.long)
    q_pos = torch.zeros(n_rows, q_len, dtype=torch.long)
    k_pos = torch.zeros(n_rows, k_len, dtype=torch.long)
    valid = torch.zeros(n_rows, q_len, dtype=torch.bool)
    k_slots = torch.empty(n_rows, k_len, dtype=torch.long, device=device)
    mask = torch.zeros(n_rows, q_len, k_len, dtype=torch.bool, device=device)
    for r, (qi, keys, m, qp, kp) in enumerate(rows):
        nq, nk = qi.numel(), keys.numel()
        q_index[r, :nq], q_index[r, nq:] = qi, qi[0]
        q_pos[r, :nq], q_pos[r, nq:] = qp, kp[0]  # a padded query sees key 0 (below), at its position: in any span
        k_pos[r, :nk], k_pos[r, nk:] = kp, qp[0]
        valid[r, :nq] = True
        k_slots[r, :nk], k_slots[r, nk:] = keys, keys[0]  # a written slot: never NaN garbage
        mask[r, :nq, :nk] = m
        mask[r, nq:, 0] = True  # padded queries see one key, so no row is fully masked
    q_index, valid = q_index.flatten(), valid.flatten()
    return Bucket(n_rows, q_len, k_len, q_index.to(device), k_slots.flatten(),
                  mask.repeat(1, groups, 1)[:, None], valid.to(device), q_index[valid].to(device),
                  q_pos.to(device), k_pos.to(device))
