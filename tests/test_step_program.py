"""The step program runner (kvql.engine.model.kernels.step_program): its own operations equal the torch ops they
replace bit for bit, and a kernel's error surfaces as an exception naming the call. (The whole bound decode
program is compared with the model's forward in tests/test_lean_model.py.)"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvql.engine.model.kernels import gemv, step_program

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
BF16 = {torch.float32: 0, torch.bfloat16: 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rounds_as_torch_add(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 40, generator=g) * 100).to(dtype)
    y = torch.randn(3, 40, generator=g).to(dtype)
    bias = torch.randn(40, generator=g).to(dtype)
    want = (x.clone() + y) + bias
    p = step_program.Program()
    p.add("add", None, x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), 3, 40, BF16[dtype])
    p.add("add", None, x.data_ptr(), x.stride(0), bias.data_ptr(), 0, 3, 40, BF16[dtype])
    p.run((0,) * step_program.TAIL)
    assert torch.equal(x, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_is_index_copy(dtype):
    g = torch.Generator().manual_seed(1)
    pool, rows, kv, d = torch.zeros(2, 50, 8, dtype=dtype), 3, 2, 8
    qkv = torch.randn(rows, 5 * d, generator=g).to(dtype)
    source = qkv[:, 3 * d:]  # two heads' rows inside a wider row, as k or v in a q/k/v row
    slots = torch.tensor([7, 42, 3])
    want = pool.clone().index_copy_(1, slots, source.view(rows, kv, d).transpose(0, 1))
    p = step_program.Program()
    p.add("write_kv", None, pool.data_ptr(), pool.stride(0), pool.stride(1), source.data_ptr(), source.stride(0),
          slots.data_ptr(), rows, kv, d, pool.element_size())
    p.run((0,) * step_program.TAIL)
    assert torch.equal(pool, want)


@pytest.mark.skipif(not gemv.available(torch.float32), reason="no float32 gemv on this CPU")
def test_a_kernel_error_raises_naming_the_call():
    w = gemv.pack(torch.randn(64, 32))
    x, out = torch.randn(1, 32), torch.empty(1, 64)
    p = step_program.Program()
    p.add("gemv", gemv.LIBRARY.get().kvql_gemv, x.data_ptr(), 32, w.data_ptr(), out.data_ptr(), 64, 1, 64, 32, 0, 1)
    p.add("gemv", gemv.LIBRARY.get().kvql_gemv, x.data_ptr(), 32, w.data_ptr(), out.data_ptr(), 64, 0, 64, 32, 0, 1)
    with pytest.raises(RuntimeError, match=r"gemv call \(#1\) failed"):
        p.run((0,) * step_program.TAIL)
    assert torch.allclose(out, x @ gemv_weight(w).T, rtol=1e-5, atol=1e-5)  # the first call ran


def gemv_weight(packed: torch.Tensor) -> torch.Tensor:
    """The weight `gemv.pack` made `packed` from (float32: [n / 16, k, 16])."""
    n, k = gemv.shape(packed)
    return packed.transpose(1, 2).reshape(n, k)
