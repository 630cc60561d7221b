"""The small-batch kernel (kvql.engine.model.kernels.gemv): in bf16 each output row bit for bit oneDNN's prepacked
GEMM's, in fp32 equal to it to float32 rounding; whatever the rows beside it; kvql's linear layers take it
for few rows and fall back without it."""

from __future__ import annotations

import pytest
import torch

from kvql.engine.model import cpu_linear
from kvql.engine.model.kernels import gemv

needs_kernel = pytest.mark.skipif(not (cpu_linear.can_pack(torch.bfloat16) and gemv.rounds_as_onednn()),
                                  reason="no oneDNN bf16 packing, no compiler or no AVX512_BF16")
needs_widening = pytest.mark.skipif(not gemv.any_rows(torch.bfloat16),
                                    reason="the widening bf16 kernel is built where AVX2 with FMA lacks AVX512_BF16")
needs_f32_kernel = pytest.mark.skipif(not (cpu_linear.can_pack() and gemv.available(torch.float32)),
                                      reason="no oneDNN, no compiler or neither AVX512F nor AVX2 with FMA")

# the models' layer shapes in bf16 (out, in): SmolLM2-135M (q/k/v stacked, gate/up stacked, down's 1,536
# inputs in two slices, lm_head) and Gemma 3 270M (q, k/v, o, gate/up, down in slices of 1,024)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 768), (49152, 576),
          (1024, 640), (256, 640), (640, 1024), (4096, 640), (64, 34)]


def _onednn(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_equal_onednn_bit_for_bit_at_every_batch_size(shape):
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    w = (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)
    blocked = gemv.pack(w)
    for rows in range(1, gemv.max_rows() + 1):
        x = torch.randn(rows, shape[1], generator=g).to(torch.bfloat16)
        assert torch.equal(gemv.gemv(x, blocked), _onednn(x, w)), rows


@needs_kernel
def test_a_row_does_not_depend_on_the_rows_beside_it():
    w = (torch.randn(640, 640) * 0.05).to(torch.bfloat16)
    x = torch.randn(8, 640).to(torch.bfloat16)
    blocked = gemv.pack(w)
    together = gemv.gemv(x, blocked)
    for i in range(8):
        assert torch.equal(gemv.gemv(x[i:i + 1], blocked)[0], together[i])


@needs_kernel
def test_shapes_outside_the_contract_are_not_taken():
    assert not gemv.supports(torch.empty(96, 64, dtype=torch.bfloat16))  # outputs not a multiple of 64
    assert not gemv.supports(torch.empty(64, 63, dtype=torch.bfloat16))  # odd inputs
    assert not gemv.supports(torch.empty(64, 64, dtype=torch.float16))  # a dtype it has no arithmetic for


@needs_kernel
def test_a_layer_gives_the_same_bits_with_and_without_the_kernel(monkeypatch):
    """One row through the kernel, 24 rows through oneDNN, 3 rows with the kernel switched off: equal."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(1536, 576, bias=False).to(torch.bfloat16)
    x = torch.randn(24, 1536).to(torch.bfloat16)
    with torch.inference_mode():
        layer = cpu_linear.packed(layer, max_reduction=cpu_linear.MAX_REDUCTION)
        assert all(blocked is not None for _, _, blocked in layer.packs.slices)
        batch = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(24)])
        monkeypatch.setattr(cpu_linear, "GEMV_ROWS", 0)  # as with KVQL_GEMV=0: oneDNN at every size
        off = torch.cat([layer(x[i:i + 1]) for i in range(24)])
    assert torch.equal(alone, batch) and torch.equal(off, batch)


@needs_widening
@pytest.mark.parametrize("shape", SHAPES[:5])
def test_the_widening_kernel_takes_any_rows_and_a_row_never_depends_on_them(shape):
    """bf16 without AVX512_BF16: one float32 chain per output, rounded once, whatever the rows around it (four
    at a time or one), close to the float32 product."""
    g = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(37, shape[1], generator=g).to(torch.bfloat16)
    blocked = gemv.pack(w)
    together = gemv.gemv(x, blocked)
    for a, b in ((0, 1), (3, 7), (8, 12), (30, 37), (5, 6), (10, 12), (20, 23)):
        assert torch.equal(gemv.gemv(x[a:b], blocked), together[a:b]), (a, b)
    want = (x.float() @ w.float().T)
    torch.testing.assert_close(together.float(), want, rtol=1e-2, atol=1e-2)


@needs_widening
def test_a_bf16_layer_runs_the_widening_kernel_at_every_batch_size():
    """Where oneDNN packs no bf16 weight, a bf16 layer (sliced past MAX_REDUCTION) takes the kernel at every
    batch size: 24 rows at once equal each row alone, and the plain kernel still serves autograd."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(1536, 576, bias=True).to(torch.bfloat16)
    x = torch.randn(24, 1536).to(torch.bfloat16)
    with torch.inference_mode():
        layer = cpu_linear.packed(layer, max_reduction=cpu_linear.MAX_REDUCTION)
        if cpu_linear.can_pack(torch.bfloat16):
            pytest.skip("oneDNN packs bf16 weights here: the kernel only serves few rows")
        assert all(packed is None and blocked is not None for _, packed, blocked in layer.packs.slices)
        batch = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(24)])
    assert torch.equal(alone, batch)
    torch.testing.assert_close(batch.float(), torch.nn.functional.linear(x.float(), layer.weight.float(),
                                                                         layer.bias.float()), rtol=2e-2, atol=2e-2)


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("KVQL_GEMV", "0")
    assert not gemv.available() and gemv.max_rows() == 0
    layer = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    layer = cpu_linear.packed(layer)
    assert all(blocked is None for _, _, blocked in layer.packs.slices)


@needs_f32_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_float32_rows_equal_onednn_to_float32_rounding(shape):
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    w = torch.randn(*shape, generator=g) * 0.05
    blocked = gemv.pack(w)
    for rows in range(1, gemv.max_rows() + 1):
        x = torch.randn(rows, shape[1], generator=g)
        exact = (x.double() @ w.double().T)
        got = gemv.gemv(x, blocked)
        assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
        # an fp32 dot product of k terms: error bound ~ k * eps * sum |x w|
        bound = shape[1] * 2**-24 * (x.double().abs() @ w.double().abs().T)
        assert ((got.double() - exact).abs() <= bound).all(), rows
        # oneDNN sums in its own order (it differs between CPUs): both within the bound, so within twice it
        assert ((got.double() - _onednn(x, w).double()).abs() <= 2 * bound).all(), rows


@needs_f32_kernel
def test_a_float32_row_does_not_depend_on_the_rows_beside_it():
    w = torch.randn(640, 640) * 0.05
    x = torch.randn(8, 640)
    blocked = gemv.pack(w)
    together = gemv.gemv(x, blocked)
    for rows in range(1, 8):  # each row count its own mix of the one-row and two-to-four-row kernels
        assert torch.equal(gemv.gemv(x[:rows], blocked), together[:rows]), rows
    for i in range(8):
        assert torch.equal(gemv.gemv(x[i:i + 1], blocked)[0], together[i])


@needs_f32_kernel
def test_a_float32_layer_takes_the_kernel_for_few_rows_and_agrees_with_onednn(monkeypatch):
    torch.manual_seed(0)
    layer = torch.nn.Linear(576, 960, bias=False)
    x = torch.randn(24, 576)
    with torch.inference_mode():
        layer = cpu_linear.packed(layer)
        assert all(blocked is not None for _, _, blocked in layer.packs.slices)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(24)])
        batch = layer(x)
        monkeypatch.setattr(cpu_linear, "GEMV_ROWS", 0)
        off = torch.cat([layer(x[i:i + 1]) for i in range(24)])
    assert torch.allclose(alone, batch, rtol=1e-5, atol=1e-6) and torch.allclose(off, batch, rtol=1e-5, atol=1e-6)
