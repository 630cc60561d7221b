"""Paged attention on the CPU: a request's new tokens attend over its K/V slots read in place from the pool,
without gathering them (paged_attention.c, compiled here with the system C compiler).

Contract of `attend`: for each segment, each of its `q_len` new tokens (flat positions `q_start ...`)
attends causally over the first `n_keys - q_len + i + 1` of its slots (`slots[key_start : key_start +
n_keys]`: its past, then its new tokens, whose K/V the layer has already written to the pool), or, in a
layer with a sliding window of W, over the last W of those, or, with chunked attention of C (Llama 4), over
those from the start of its chunk (key index a multiple of C) on, and its output rows are written to
`out [T, heads, head_dim]`. A windowed layer reads only the keys in its window (on long contexts it costs
less than a full one). Float32 arithmetic for float32 and bfloat16
storage. One task per (segment, block of 16 new tokens, KV head), keys in slot-list order: a segment's
result does not depend on the other segments of the call, nor on how its tokens were split into calls
(the C file's doc): batch-invariant by construction.

Why a kernel: without it, every step copies each request's K/V out of the pool (index_select) before SDPA
reads it again, a large share of a batched decode step over a few hundred tokens of context; this reads it
once, in place, and a single new token's keys straight from the pool rather than widened into scratch
first. On long prompts it keeps pace with SDPA's causal kernel: the softmax uses its own vectorized exp (the
C file's `exp16`), where scalar `expf` would be its bottleneck. On an AVX2 CPU its hot loops run on 8-lane
vectors (the C file's doc): there they run over twice as fast as 16-lane ones. Measured: docs/benchmarks.md,
Design measurements.

Availability: the library is built once per machine (kvql.engine.model.kernels.build; at -O2 and with
-ffp-contract=off, see the C file).
`available()` is False when there is no compiler, the build fails, or `KVQL_PAGED_ATTENTION=0`; the
model runner then gathers and calls SDPA as before.
"""

from __future__ import annotations

import torch

from . import build

DTYPES = build.DTYPES
SIGNATURES = {"kvql_paged_attention": (build.I32, [
    build.PTR, build.I64, build.I64, build.PTR, build.PTR, build.I64, build.I64, build.PTR, build.I64, build.I64,
    build.I32, build.I32, build.I32, build.I32, build.F32, build.I64, build.F32, build.PTR, build.PTR, build.I64,
    build.PTR,
    build.PTR, build.PTR, build.PTR, build.PTR, build.I64, build.I32])}
LIBRARY = build.Library("paged_attention", "KVQL_PAGED_ATTENTION", "gathering K/V instead", SIGNATURES,
                        flags=["-ffp-contract=off"],
                        limits=("kvql_max_group", "kvql_max_dim"))


def available() -> bool:
    """Whether the kernel can run here (built on first call; a failure is warned about once)."""
    return LIBRARY.available()


def supports(device, dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel handles this pool and model (CPU, DTYPES, the library's limits on query heads per
    KV head and head dim) and can run here."""
    if not (torch.device(device).type == "cpu" and dtype in DTYPES and heads % kv_heads == 0 and available()):
        return False
    return ((kv_heads == 1 or heads // kv_heads <= LIBRARY.limits["kvql_max_group"])
            and head_dim <= LIBRARY.limits["kvql_max_dim"])


class Segments:
    """The per-step index arrays of the segments that take the kernel (int64, CPU, contiguous)."""

    def __init__(self, q_start, q_len, key_start, n_keys, slots: torch.Tensor):
        self.q_start, self.q_len, self.key_start, self.n_keys = (
            torch.tensor(x, dtype=torch.long) for x in (q_start, q_len, key_start, n_keys))
        self.slots = slots.to(torch.long).contiguous()
        self.max_keys = max(n_keys, default=0)
        self.count = len(q_start)


def attend(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
           segs: Segments, scale: float, window: int | None = None, softcap: float | None = None,
           sinks: torch.Tensor | None = None, chunk: int | None = None, alibi: torch.Tensor | None = None) -> None:
    """`query [heads, T, head_dim]` (any strides, last dim contiguous), `k_pool`/`v_pool` `[kv_heads, slots,
    head_dim]` (last dim contiguous, same strides; the same tensor where the keys are the values: MLA's absorbed
    form), `out [T, heads, head_dim]` (last dim contiguous); all one dtype
    of DTYPES on the CPU. Writes the rows of `segs`' tokens into `out` (module doc). `window`: each token
    sees only its last `window` keys (itself included; transformers' sliding window), `softcap`: scores
    become `softcap * tanh(score / softcap)` (Gemma 2's attention logit soft-capping), `sinks` (`[heads]`
    float32, contiguous): one more logit per head in each softmax, whose weight goes to no value (gpt-oss's
    attention sinks), `chunk`: each token sees only the keys of its own chunk of `chunk` positions (chunked
    attention; not with a window), `alibi` (`[heads]` float32, contiguous): ALiBi's slope per head, each score
    gaining slope * its key's position in the sequence (Bloom's, MPT's)."""
    if not segs.count:
        return
    assert not (window and chunk)
    for x in (sinks, alibi):
        assert x is None or (x.dtype == torch.float32 and x.is_contiguous() and x.numel() == query.shape[0])
    lib = LIBRARY.get()
    heads, _, d = query.shape
    kv_heads = k_pool.shape[0]
    assert query.stride(-1) == k_pool.stride(-1) == out.stride(-1) == 1 and k_pool.stride() == v_pool.stride()
    most = LIBRARY.limits["kvql_max_group"]
    if kv_heads == 1 and heads > most:  # MQA over many heads (MLA's): each call a share of the heads, alike
        for h in range(0, heads, most):
            part = slice(h, h + most)
            attend(query[part], k_pool, v_pool, out[:, part], segs, scale, window, softcap,
                   None if sinks is None else sinks[part], chunk, None if alibi is None else alibi[part])
        return
    rc = lib.kvql_paged_attention(
        query.data_ptr(), query.stride(1), query.stride(0),
        k_pool.data_ptr(), v_pool.data_ptr(), k_pool.stride(0), k_pool.stride(1),
        out.data_ptr(), out.stride(0), out.stride(1),
        heads, kv_heads, d, DTYPES[query.dtype], scale,
        -int(chunk) if chunk else int(window or 0),  # the C side's one span argument: negative for a chunk
        float(softcap or 0.0), None if sinks is None else sinks.data_ptr(), None if alibi is None else alibi.data_ptr(),
        segs.count, segs.q_start.data_ptr(),
        segs.q_len.data_ptr(), segs.key_start.data_ptr(), segs.n_keys.data_ptr(), segs.slots.data_ptr(),
        segs.max_keys, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"paged attention failed: shape out of range (heads {heads}, kv_heads {kv_heads}, "
                           f"head_dim {d}) or out of memory")
