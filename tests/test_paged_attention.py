"""The paged attention kernel (kvql.engine.model.kernels.paged_attention): causal attention over slots read in place equals
float64 SDPA over the gathered slots; a segment's rows do not depend on the other segments of the call, on
where its queries fall in the kernel's query blocks, or on how its tokens were split into chunks; the
runner falls back to gather + SDPA when the kernel is switched off, with the same greedy tokens."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

import kvql
from conftest import random_prompts
from kvql.engine.model.kernels import paged_attention as pa

# the kernel is optional where there is no C compiler; where there is one it must build (not skip into green)
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


def test_kernel_builds_where_a_compiler_is():
    assert pa.available(), pa.LIBRARY.error


H, KV, D, SLOTS = 9, 3, 64, 3000
SPEC = [(0, 1), (5, 3), (0, 17), (40, 9), (100, 1), (3, 8), (0, 30), (7, 25)]  # (past, new tokens) per segment


def _case(dtype, seed=0, d=D):
    g = torch.Generator().manual_seed(seed)
    k_pool, v_pool = (torch.randn(KV, SLOTS, d, generator=g).to(dtype) for _ in range(2))
    perm = torch.randperm(SLOTS, generator=g)
    q_start, q_len, key_start, n_keys, slots, t, k = [], [], [], [], [], 0, 0
    for past, n in SPEC:
        q_start.append(t), q_len.append(n), key_start.append(k), n_keys.append(past + n)
        slots.append(perm[k:k + past + n])
        t, k = t + n, k + past + n
    query = torch.randn(1, t, H, d, generator=g).to(dtype).transpose(1, 2)[0]  # [H, T, d] as a model's, strided
    return k_pool, v_pool, query, (q_start, q_len, key_start, n_keys), slots


def _run(query, k_pool, v_pool, q_start, q_len, key_start, n_keys, slots):
    d = query.shape[-1]
    out = torch.full((query.shape[1], H, d), float("nan"), dtype=query.dtype)
    pa.attend(query, k_pool, v_pool, out, pa.Segments(q_start, q_len, key_start, n_keys, torch.cat(slots)), d ** -0.5)
    return out


@pytest.mark.parametrize("d", [64, 128, 40])  # the kernel's two specialized head sizes, and a padded one
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_matches_float64_sdpa_over_gathered_slots(dtype, tol, d):
    k_pool, v_pool, query, idx, slots = _case(dtype, d=d)
    out = _run(query, k_pool, v_pool, *idx, slots)
    for (past, n), start, s in zip(SPEC, idx[0], slots):
        q = query[:, start:start + n].double().view(KV, H // KV, n, d)
        mask = torch.arange(past + n)[None] <= torch.arange(past, past + n)[:, None]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k_pool[:, s].double()[:, None], v_pool[:, s].double()[:, None], attn_mask=mask)
        torch.testing.assert_close(out[start:start + n].double(), ref.reshape(H, n, d).transpose(0, 1),
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("d", [64, 40])
def test_attention_sinks_match_float64_attention_with_a_logit_per_head(d):
    """gpt-oss's sinks: one more logit per query head in each softmax, its weight going to no value; decode
    rows (read in place) and prefill blocks alike. Without them the rows differ (the sinks are not ignored)."""
    k_pool, v_pool, query, idx, slots = _case(torch.float32, seed=3, d=d)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(4)) * 2
    segs = pa.Segments(*idx, torch.cat(slots))
    out = torch.full((query.shape[1], H, d), float("nan"))
    pa.attend(query, k_pool, v_pool, out, segs, d ** -0.5, sinks=sinks)
    plain = _run(query, k_pool, v_pool, *idx, slots)
    for (past, n), start, s in zip(SPEC, idx[0], slots):
        q = query[:, start:start + n].double()  # [H, n, d]
        k, v = (x[:, s].double().repeat_interleave(H // KV, 0) for x in (k_pool, v_pool))
        scores = (q @ k.transpose(1, 2)) * d ** -0.5
        scores = scores.masked_fill(torch.arange(past + n)[None] > torch.arange(past, past + n)[:, None], -torch.inf)
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(H, n, 1)], -1)
        ref = torch.softmax(scores, -1)[..., :-1] @ v
        torch.testing.assert_close(out[start:start + n].double(), ref.transpose(0, 1), atol=2e-6, rtol=2e-6)
        assert not torch.allclose(out[start:start + n], plain[start:start + n], atol=1e-4)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("d", [64, 40])
def test_alibi_matches_float64_attention_with_a_slope_per_head(d, window):
    """ALiBi (Bloom, MPT): each score gains its head's slope times its key's position; decode rows (read in place)
    and prefill blocks alike, also where a window starts the keys past the sequence's start. Without the slopes
    the rows differ (they are not ignored)."""
    k_pool, v_pool, query, idx, slots = _case(torch.float32, seed=5, d=d)
    slopes = torch.rand(H, generator=torch.Generator().manual_seed(6)) * 0.5
    segs = pa.Segments(*idx, torch.cat(slots))
    out = torch.full((query.shape[1], H, d), float("nan"))
    pa.attend(query, k_pool, v_pool, out, segs, d ** -0.5, window=window, alibi=slopes)
    plain = torch.full_like(out, float("nan"))
    pa.attend(query, k_pool, v_pool, plain, segs, d ** -0.5, window=window)
    for (past, n), start, s in zip(SPEC, idx[0], slots):
        q = query[:, start:start + n].double()  # [H, n, d]
        k, v = (x[:, s].double().repeat_interleave(H // KV, 0) for x in (k_pool, v_pool))
        keys, rows = torch.arange(past + n), torch.arange(past, past + n)[:, None]
        scores = (q @ k.transpose(1, 2)) * d ** -0.5 + slopes.double()[:, None, None] * keys
        hidden = (keys[None] > rows) | ((keys[None] <= rows - window) if window else False)
        ref = torch.softmax(scores.masked_fill(hidden, -torch.inf), -1) @ v
        torch.testing.assert_close(out[start:start + n].double(), ref.transpose(0, 1), atol=2e-6, rtol=2e-6)
        if past + n > 1:
            assert not torch.allclose(out[start:start + n], plain[start:start + n], atol=1e-4)


@pytest.mark.parametrize("heads,d", [(20, 576), (40, 288)])  # DeepSeek's latent + rotary width; past 16 heads
def test_mla_absorbed_form_keys_as_values_many_heads_wide(heads, d):
    """MLA in its absorbed form (latent_attention.py): one KV head whose keys are also its values (the same pool
    tensor), more query heads than the kernel takes per call (split into calls by heads), a head dim past 256:
    equals float64 attention, decode rows (read in place) and prefill blocks alike."""
    g = torch.Generator().manual_seed(7)
    k_pool = torch.randn(1, 400, d, generator=g)
    spec = [(0, 1), (9, 1), (30, 5), (0, 20)]
    perm, rows, start, keys = torch.randperm(400, generator=g), [], 0, 0
    for past, n in spec:
        rows.append((past, n, start, perm[keys:keys + past + n]))
        start, keys = start + n, keys + past + n
    query = torch.randn(1, start, heads, d, generator=g).transpose(1, 2)[0]  # [heads, T, d], strided
    segs = pa.Segments([r[2] for r in rows], [r[1] for r in rows], [0, 1, 11, 46][:len(rows)],
                       [r[0] + r[1] for r in rows], torch.cat([r[3] for r in rows]))
    out = torch.full((start, heads, d), float("nan"))
    pa.attend(query, k_pool, k_pool, out, segs, 0.1)
    for past, n, at, s in rows:
        q, k = query[:, at:at + n].double(), k_pool[0, s].double()
        scores = (q @ k.T) * 0.1
        scores = scores.masked_fill(torch.arange(past + n)[None] > torch.arange(past, past + n)[:, None], -torch.inf)
        torch.testing.assert_close(out[at:at + n].double(), (torch.softmax(scores, -1) @ k).transpose(0, 1),
                                   atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("chunk", [8, 16, 20, 64])  # below, at and off the kernel's 16-key alignment, and above
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_chunked_attention_matches_float64_attention_within_each_chunk(dtype, tol, chunk):
    """Llama 4's chunked attention: a token sees only the keys of its own chunk (positions `p // chunk` alike),
    decode rows (read in place) and prefill blocks alike; a row's output does not depend on how its tokens were
    split. Where a segment crosses a chunk boundary, rows differ from full attention (the chunk is not
    ignored)."""
    k_pool, v_pool, query, idx, slots = _case(dtype, seed=5)
    segs = pa.Segments(*idx, torch.cat(slots))
    out = torch.full((query.shape[1], H, D), float("nan"), dtype=dtype)
    pa.attend(query, k_pool, v_pool, out, segs, D ** -0.5, chunk=chunk)
    plain = _run(query, k_pool, v_pool, *idx, slots)
    for (past, n), start, s in zip(SPEC, idx[0], slots):
        q = query[:, start:start + n].double().view(KV, H // KV, n, D)
        i, j = torch.arange(past, past + n)[:, None], torch.arange(past + n)[None]
        mask = (j <= i) & (j // chunk == i // chunk)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k_pool[:, s].double()[:, None], v_pool[:, s].double()[:, None], attn_mask=mask)
        torch.testing.assert_close(out[start:start + n].double(), ref.reshape(H, n, D).transpose(0, 1),
                                   atol=tol, rtol=tol)
        if past + n > chunk:
            assert not torch.allclose(out[start + n - 1], plain[start + n - 1], atol=1e-3)
        for cut in range(1, n):
            first, rest = (torch.full((m, H, D), float("nan"), dtype=dtype) for m in (cut, n - cut))
            qs = query[:, start:start + n]
            pa.attend(qs[:, :cut], k_pool, v_pool, first, pa.Segments([0], [cut], [0], [past + cut], s[:past + cut]),
                      D ** -0.5, chunk=chunk)
            pa.attend(qs[:, cut:], k_pool, v_pool, rest, pa.Segments([0], [n - cut], [0], [past + n], s),
                      D ** -0.5, chunk=chunk)
            assert torch.equal(torch.cat([first, rest]), out[start:start + n]), (past, n, cut)


@pytest.mark.parametrize("d", [64, 128, 40, 256])  # specialized, padded, and Gemma 3's (no specialization)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_independent_of_batch_mates_and_of_chunking(dtype, d):
    k_pool, v_pool, query, (q_start, q_len, key_start, n_keys), slots = _case(dtype, d=d)
    out = _run(query, k_pool, v_pool, q_start, q_len, key_start, n_keys, slots)
    for i, (past, n) in enumerate(SPEC):
        q = query[:, q_start[i]:q_start[i] + n]
        alone = _run(q, k_pool, v_pool, [0], [n], [0], [past + n], [slots[i]])
        assert torch.equal(alone, out[q_start[i]:q_start[i] + n]), i
        for cut in range(1, n):  # the first `cut` new tokens, then the rest over them as past
            first = _run(q[:, :cut], k_pool, v_pool, [0], [cut], [0], [past + cut], [slots[i][:past + cut]])
            rest = _run(q[:, cut:], k_pool, v_pool, [0], [n - cut], [0], [past + n], [slots[i]])
            assert torch.equal(torch.cat([first, rest]), alone), (i, cut)


def test_engine_without_kernel_gives_the_same_greedy_tokens(tokenizer, llama, monkeypatch):
    prompts = random_prompts(seed=3, count=10, vocab=len(tokenizer), prefix_lengths=(0, 9, 30))
    outputs = []
    for switch in ("1", "0"):
        monkeypatch.setenv("KVQL_PAGED_ATTENTION", switch)
        m = kvql.Model(llama, tokenizer, cache_budget="8MB", background=False)
        try:
            assert m.engine.runner.paged is (switch == "1")
            outputs.append([c.token_ids for c in m.generate(prompts, max_tokens=10)])
            m.check_integrity()
        finally:
            m.close()
    assert outputs[0] == outputs[1]


def test_a_thread_that_ends_frees_its_scratch():
    """The kernel keeps per-thread scratch between calls; the engine releases idle OpenMP pools, whose
    worker threads then end: their scratch must go with them (it leaked ~5 MiB per thread here)."""
    from kvql.engine import openmp

    def rss_mib() -> float:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    n = 4000  # 64 queries over 4,000 keys: ~5 MiB of scratch per thread
    k_pool, v_pool = torch.randn(KV, n, D), torch.randn(KV, n, D)
    query, out = torch.randn(H, 64, D), torch.empty(64, H, D)
    segs = pa.Segments([0], [64], [0], [n], torch.arange(n))

    def work():
        pa.attend(query, k_pool, v_pool, out, segs, D ** -0.5)
        openmp.release()  # its workers end too
    threads, before = torch.get_num_threads(), 0.0
    torch.set_num_threads(2)
    try:
        for i in range(23):
            if i == 3:  # (allocator and thread-stack caches warm)
                before = rss_mib()
            t = threading.Thread(target=work)
            t.start()
            t.join()
    finally:
        torch.set_num_threads(threads)
    assert rss_mib() - before < 40  # leaking: 20 threads x 2 x ~5 MiB


def test_a_truncated_cached_library_is_built_again_not_loaded(tmp_path):
    # loading a truncated .so maps it and dies with SIGBUS at the first call (issue 25): each build records
    # the library's size and checksum, and a library that no longer matches them is rebuilt, with a warning
    import subprocess
    import sys

    env = {**os.environ, "KVQL_CACHE_DIR": str(tmp_path)}
    script = ("import warnings, torch\nfrom kvql.engine.model.kernels import build\n"
              "with warnings.catch_warnings(record=True) as w:\n"
              "    warnings.simplefilter('always')\n"
              "    lib = build.load('fused_ops')\n"
              "print('warned' if any('damaged' in str(x.message) for x in w) else 'quiet')\n")
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and first.stdout.strip() == "quiet", first.stderr[-2000:]
    (lib,) = (tmp_path / "kernels").glob("fused_ops-*.so")
    lib.write_bytes(lib.read_bytes()[:lib.stat().st_size // 3])
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and second.stdout.strip() == "warned", second.stderr[-2000:]
    assert (lib.with_suffix(".sha256")).read_text().split()[0] == str(lib.stat().st_size)
