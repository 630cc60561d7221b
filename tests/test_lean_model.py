"""The lean forward (kvql.engine.model.lean_model): for every family it takes (Llama's structure, q/k norms or not, and
Gemma 3's), logits and pool contents equal the model's own forward's bit for bit (steps of up to
`cpu_linear.gemv_rows` tokens through the bound program, longer chunks through the module-level path), in float32 and bfloat16; families it does not take keep the model's forward; hooks and weight
edits are followed."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import families
from kvql.engine.model import cpu_linear
from kvql.engine.model.kernels import gemv
from kvql.engine.cache.kv_pool import KVPool
from kvql.engine.model.model_runner import ModelRunner, Segment, read_geometry

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
EMPTY = torch.empty(0, dtype=torch.long)
VOCAB = 256  # a multiple of 64: lm_head takes gemv too


def _runner(family: str, dtype: torch.dtype, seed: int = 0):
    model_type, overrides = families.FAMILIES[family]
    hf = families.build(model_type, overrides, VOCAB, eos_token_id=1, seed=seed).to(dtype)
    geometry = read_geometry(hf)
    pool = KVPool(num_layers=len(geometry.layers), kv_heads=geometry.kv_heads, head_dim=geometry.head_dim,
                  num_slots=512, dtype=dtype, device="cpu")
    return ModelRunner(hf, pool, geometry), pool


def _steps(runner, pool, lean) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A 23-token prompt, then steps of 1, 2, 3, 4, 6, 9 and 1 tokens (two requests in the 3-token step), past the
    tiny window; every step's logits, and the pool's K and V."""
    runner.lean = lean
    pool.k.zero_(), pool.v.zero_()
    g = torch.Generator().manual_seed(5)
    slots = torch.arange(200)
    prompt = torch.randint(2, VOCAB, (23,), generator=g).tolist()
    out = runner.forward([Segment(prompt, 0, EMPTY, slots[:23], True, all_logits=True)])
    n, other = 23, 150  # a second request: its own slots from 150
    runner.forward([Segment(prompt[:7], 0, EMPTY, slots[other:other + 7], True)])
    for t in (1, 2, 3, 4, 6, 9, 1):
        ids = torch.randint(2, VOCAB, (t,), generator=g).tolist()
        segs = [Segment(ids, n, slots[:n], slots[n:n + t], True, all_logits=True)]
        if t == 3:  # two requests in one step: 2 + 1 tokens
            segs = [Segment(ids[:2], n, slots[:n], slots[n:n + 2], True, all_logits=True),
                    Segment(ids[2:], 7, slots[other:other + 7], slots[other + 7:other + 8], True)]
            other += 1
        out += runner.forward(segs)
        n += len(segs[0].token_ids)
    return out, pool.k.clone(), pool.v.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_lean_forward_is_the_models_forward_bit_for_bit(family, dtype):
    runner, pool = _runner(family, dtype)
    lean = runner.lean
    assert lean is not None, f"{family} has a structure the lean forward takes"
    want, k, v = _steps(runner, pool, None)
    got, k2, v2 = _steps(runner, pool, lean)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    # the bound program ran the decode steps wherever gemv computes these layers at few rows (else the
    # module-level path did): float32 with the kernel; bf16 beside oneDNN's packed weights where it rounds as
    # oneDNN does, or alone where oneDNN packs none
    packs = cpu_linear.can_pack(torch.bfloat16)
    takes = gemv.available(dtype) and (dtype == torch.float32 or (gemv.rounds_as_onednn() if packs
                                                                  else gemv.any_rows(dtype)))
    assert (lean._programs.get(1) is not None) == takes
    assert (lean._programs.get(6) is not None) == (takes and cpu_linear.gemv_rows(dtype) >= 6)


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma2", "phi3", "olmo2", "gpt2"])
def test_other_structures_keep_the_models_forward(family):
    runner, _ = _runner(family, torch.float32)
    assert runner.lean is None


def test_a_hook_keeps_the_models_forward():
    model_type, overrides = families.FAMILIES["llama"]
    hf = families.build(model_type, overrides, VOCAB, eos_token_id=1)
    hf.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    geometry = read_geometry(hf)
    pool = KVPool(num_layers=len(geometry.layers), kv_heads=geometry.kv_heads, head_dim=geometry.head_dim,
                  num_slots=64, dtype=torch.float32, device="cpu")
    assert ModelRunner(hf, pool, geometry).lean is None


def test_a_weight_edited_in_place_is_followed():
    """The bound program holds gemv's copies of the weights: an edit makes it build again, so the lean forward
    still equals the model's own (which repacks as well)."""
    runner, pool = _runner("llama", torch.float32)
    lean = runner.lean
    _steps(runner, pool, lean)
    with torch.no_grad():
        runner.model.model.layers[1].mlp.down_proj.weight.mul_(-1.5)
        runner.model.model.layers[0].self_attn.k_proj.weight.add_(0.25)
    want, k, v = _steps(runner, pool, None)
    got, k2, v2 = _steps(runner, pool, lean)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(k, k2) and torch.equal(v, v2)
