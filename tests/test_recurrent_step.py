"""kvql's recurrent kernels over ragged batches (kvql/engine/model/kernels/recurrent_step.py, mixer_steps.py): the
short convolution and the gated delta rule equal transformers' own torch steps (outputs and the states they leave),
a segment's result depends neither on its batch mates nor on how its tokens were split into calls, each state is
updated where it lies; Qwen3.5- and LFM2-shaped models run on them in the engine, and a computation made wrong is
caught by the load check."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

import families as F
from kvql.engine.model.kernels import recurrent_step as rs

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


def test_kernels_build_where_a_compiler_is():
    assert rs.available(), rs.LIBRARY.error


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_short_conv_equals_transformers_update_and_leaves_the_same_states(dtype, tol, bias):
    g = torch.Generator().manual_seed(0)
    rows, channels, taps = 5, 72, 4  # channels past a multiple of 16: the activation's scalar tail too
    x = torch.randn(rows, channels, generator=g).to(dtype)
    w = torch.randn(channels, taps, generator=g).to(dtype)
    b = torch.randn(channels, generator=g).to(dtype) if bias else None
    states = [torch.randn(1, channels, taps, generator=g).to(dtype) for _ in range(rows)]
    want_states = [s.clone() for s in states]
    want = torch.cat([q35.causal_conv1d_update(x[r:r + 1, :, None], want_states[r], w, b, "silu")[..., 0]
                      for r in range(rows)])
    got = rs.short_conv_(x, rs.Segments.single(rows), states, w, b, silu=True)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    for s, t in zip(states, want_states):
        assert torch.equal(s, t)  # the shift is exact


def test_gated_delta_equals_transformers_recurrent_step_and_leaves_the_same_states():
    g = torch.Generator().manual_seed(1)
    rows, hk, hv, dk, dv = 4, 2, 6, 32, 48
    q, k = (torch.nn.functional.normalize(torch.randn(rows, hk, dk, generator=g), dim=-1) for _ in range(2))
    q = q / dk ** 0.5
    v = torch.randn(rows, hv, dv, generator=g)
    decay = -torch.rand(rows, hv, generator=g)
    beta = torch.rand(rows, hv, generator=g)
    states = [torch.randn(1, hv, dk, dv, generator=g) for _ in range(rows)]
    want_out, want_states = [], []
    for r in range(rows):  # transformers' step normalizes and scales itself: given q * sqrt(dk), unnormalized off
        out, state = q35.torch_recurrent_gated_delta_rule(
            (q[r] * dk ** 0.5)[None, None], k[r][None, None], v[r][None, None], decay[r][None, None],
            beta[r][None, None], initial_state=states[r].clone(), output_final_state=True)
        want_out.append(out[0, 0])
        want_states.append(state)
    ptrs = [s.data_ptr() for s in states]
    got = rs.gated_delta_(q, k, v, decay, beta, rs.Segments.single(rows), states)
    torch.testing.assert_close(got, torch.stack(want_out), atol=1e-5, rtol=1e-5)
    for s, t, p in zip(states, want_states, ptrs):
        torch.testing.assert_close(s, t, atol=1e-5, rtol=1e-5)
        assert s.data_ptr() == p  # in place


def test_a_rows_step_does_not_depend_on_its_batch_mates():
    g = torch.Generator().manual_seed(2)
    rows, hk, hv, dk, dv = 6, 2, 4, 16, 16
    args = [torch.randn(rows, hk, dk, generator=g), torch.randn(rows, hk, dk, generator=g),
            torch.randn(rows, hv, dv, generator=g), -torch.rand(rows, hv, generator=g),
            torch.rand(rows, hv, generator=g)]
    states = [torch.randn(1, hv, dk, dv, generator=g) for _ in range(rows)]
    alone_states = [s.clone() for s in states]
    together = rs.gated_delta_(*args, rs.Segments.single(rows), states)
    for r in range(rows):
        alone = rs.gated_delta_(*[a[r:r + 1].contiguous() for a in args], rs.Segments.single(1), [alone_states[r]])
        assert torch.equal(alone[0], together[r]) and torch.equal(alone_states[r], states[r])
    x, w = torch.randn(rows, 32, generator=g).bfloat16(), torch.randn(32, 4, generator=g).bfloat16()
    conv = [torch.randn(1, 32, 4, generator=g).bfloat16() for _ in range(rows)]
    conv_alone = [s.clone() for s in conv]
    together = rs.short_conv_(x, rs.Segments.single(rows), conv, w, None, silu=True)
    for r in range(rows):
        alone = rs.short_conv_(x[r:r + 1], rs.Segments.single(1), [conv_alone[r]], w, None, silu=True)
        assert torch.equal(alone[0], together[r])


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "lfm2"])
def test_hybrids_step_with_kvqls_step_exactly_and_a_wrong_step_is_caught(tokenizer, monkeypatch, name):
    """The engine computes Qwen3.5's and Qwen3-Next's Gated DeltaNet and LFM2's short convolutions itself (mixer_steps.run; exact
    against transformers' generate: tests/test_families.py); made wrong (its output scaled), the load check sends
    the model to its own forward, still exact."""
    import kvql
    from kvql.engine.model import mixer_steps

    hf = F.build(*F.FAMILIES[name], len(tokenizer), tokenizer.eos_token_id)
    m = kvql.Model(hf, tokenizer, cache_budget=8 << 20)
    try:
        assert m.engine.runner.geometry.own is None and m.engine.runner.mixers.own_step
    finally:
        m.close()
    run = mixer_steps.run
    monkeypatch.setattr(mixer_steps, "run", lambda *a: None if (y := run(*a)) is None else y * 1.05)
    own, got, want = F.fallback(name, tokenizer, cache_budget=8 << 20)
    assert "the ragged path's check failed" in own and got == want


def test_a_segments_tokens_give_the_same_whatever_the_calls_and_batch_mates():
    """Ragged segments of several tokens: the outputs and states of a segment of 10 tokens computed in one call
    beside others are bit for bit those of the same tokens alone, split 4 + 6 (the recurrent form has no chunks)."""
    g = torch.Generator().manual_seed(3)
    hk, hv, dk, dv, channels = 2, 4, 16, 16, 48
    lengths = [10, 3, 7]
    rows = sum(lengths)
    q, k = torch.randn(rows, hk, dk, generator=g), torch.randn(rows, hk, dk, generator=g)
    v, decay = torch.randn(rows, hv, dv, generator=g), -torch.rand(rows, hv, generator=g)
    beta = torch.rand(rows, hv, generator=g)
    x, w = torch.randn(rows, channels, generator=g).bfloat16(), torch.randn(channels, 4, generator=g).bfloat16()
    states = [torch.randn(1, hv, dk, dv, generator=g) for _ in lengths]
    convs = [torch.randn(1, channels, 4, generator=g).bfloat16() for _ in lengths]
    first = (states[0].clone(), convs[0].clone())
    segs = rs.Segments([0, 10, 13], lengths)
    together = rs.gated_delta_(q, k, v, decay, beta, segs, states), rs.short_conv_(x, segs, convs, w, None, True)
    state, conv = first
    for a, b in ((0, 4), (4, 10)):
        part = rs.Segments([0], [b - a])
        out = rs.gated_delta_(*(t[a:b].contiguous() for t in (q, k, v, decay, beta)), part, [state])
        assert torch.equal(out, together[0][a:b])
        assert torch.equal(rs.short_conv_(x[a:b], part, [conv], w, None, True), together[1][a:b])
    assert torch.equal(state, states[0]) and torch.equal(conv, convs[0])


def test_ssd_equals_transformers_selective_state_update_and_leaves_the_same_states():
    """Mamba2's scan step (ragged_scan.py's kernel) against transformers' torch step, in float32, groups shared by
    heads, the D skip included."""
    from transformers.models.mamba2 import modeling_mamba2 as m2

    g = torch.Generator().manual_seed(4)
    rows, heads, head_dim, groups, n = 3, 4, 8, 2, 16
    x = torch.randn(rows, heads, head_dim, generator=g)
    B, C = torch.randn(rows, groups, n, generator=g), torch.randn(rows, groups, n, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(rows, heads, generator=g))
    A, D = -torch.rand(heads, generator=g) * 4, torch.randn(heads, generator=g)
    states = [torch.randn(1, heads, head_dim, n, generator=g) for _ in range(rows)]
    want_states = [s.clone() for s in states]
    want = torch.cat([m2.mamba2_selective_state_update(
        want_states[r], x[r:r + 1],
        dt[r:r + 1, :, None].expand(1, heads, head_dim), A[:, None, None].expand(heads, head_dim, n), B[r:r + 1],
        C[r:r + 1], D[:, None].expand(heads, head_dim)) for r in range(rows)])
    got = rs.ssd_(x, B, C, dt, A, D, rs.Segments.single(rows), states)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for s, t in zip(states, want_states):
        torch.testing.assert_close(s, t, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["granitemoehybrid", "falcon_h1"])
def test_mamba2_mixers_run_on_kvqls_scan_and_a_wrong_scan_is_caught(tokenizer, monkeypatch, name):
    """A Granite-4-style hybrid's (and Falcon-H1's, with its multipliers) Mamba2 mixers run their own forward over
    the whole batch, the convolution and scan by kvql's kernels (ragged_scan.py; exactness: tests/test_families.py);
    the scan made wrong, the load check sends the model to its own forward, still exact."""
    import kvql
    from kvql.engine.model import ragged_scan

    hf = F.build(*F.FAMILIES[name], len(tokenizer), tokenizer.eos_token_id)
    calls = []
    ssd = rs.ssd_
    monkeypatch.setattr(rs, "ssd_", lambda *a: calls.append(1) or ssd(*a))
    m = kvql.Model(hf, tokenizer, cache_budget=8 << 20)
    try:
        assert m.engine.runner.geometry.own is None and m.engine.runner.mixers.scans and calls
    finally:
        m.close()
    scan = ragged_scan._scan
    monkeypatch.setattr(ragged_scan, "_scan", lambda *a, **k: scan(*a, **k) + 0.1)  # (a scale the norm after it undoes)
    own, got, want = F.fallback(name, tokenizer, cache_budget=8 << 20)
    assert "the ragged path's check failed" in own and got == want
