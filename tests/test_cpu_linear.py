"""CPU linear layers (kvql.engine.model.cpu_linear): prepacked weights compute the layer's linear map and follow
edits of the weight; in bf16 with a reduction limit, each output row is computed exactly as the row alone,
whatever the rows beside it."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import kvql
from conftest import tiny_model
from kvql.engine.model import cpu_linear, fused_layers
from kvql.engine.model.cpu_linear import MAX_REDUCTION, prepare, restore

needs_onednn = pytest.mark.skipif(not cpu_linear.can_pack(), reason="this torch build has no oneDNN")


def _layer(in_features: int, bias: bool, dtype=torch.bfloat16, out_features: int = 96) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 576), (24, 576), (3, 7, 1536)])
def test_a_packed_layer_computes_the_same_linear_map(dtype, shape):
    layer = _layer(shape[-1], bias=True, dtype=dtype)
    x = torch.randn(*shape).to(dtype)
    with torch.inference_mode():
        plain = layer(x).float()
        # packed where this CPU's oneDNN packs the dtype (bf16 needs AVX-512 or AVX-NE-CONVERT), else plain
        layer = cpu_linear.packed(layer)
        assert (layer.packs.slices[0][1] is not None) == cpu_linear.can_pack(dtype)
        packed = layer(x).float()
    tol = 1e-5 if dtype == torch.float32 else 0.02
    torch.testing.assert_close(packed, plain, rtol=tol, atol=tol)


@needs_onednn
def test_the_packed_copy_follows_in_place_edits_and_dtype_changes():
    layer = _layer(64, bias=False, dtype=torch.float32)
    layer = cpu_linear.packed(layer)
    x = torch.randn(5, 64)
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # e.g. load_state_dict copies into the weight in place
        torch.testing.assert_close(layer(x), x @ layer.weight.t(), rtol=1e-5, atol=1e-5)
        layer.weight.copy_(torch.ones_like(layer.weight))
        torch.testing.assert_close(layer(x), x.sum(-1, keepdim=True).expand(5, 96), rtol=1e-5, atol=1e-5)
    layer.to(torch.bfloat16)
    with torch.no_grad():
        y = layer(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), x.sum(-1, keepdim=True).expand(5, 96), rtol=0.02, atol=0.05)


@needs_onednn
def test_a_prepared_model_can_be_copied_pickled_and_restored():
    model = torch.nn.Sequential(_layer(64, bias=True, dtype=torch.float32), torch.nn.ReLU(),
                                _layer(96, bias=False, dtype=torch.float32, out_features=8))
    x = torch.randn(4, 64)
    with torch.no_grad():
        plain = model(x)
        prepare(model)
        packed = model(x)
        twin = copy.deepcopy(model)
        twin[0].weight.zero_()  # the copy owns its weights: the original is unaffected
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        torch.testing.assert_close(model(x), packed)
        torch.testing.assert_close(loaded(x), packed)
        assert not torch.allclose(twin(x), packed)
        assert restore(model) == 2 and type(model[0]) is torch.nn.Linear
        torch.testing.assert_close(model(x), plain)


def test_prepare_replaces_layers_and_leaves_the_replaced_ones_as_they_were():
    """kvql's own module takes the layer's place over the same parameters; the transformers-made object carries
    nothing of kvql (issue 54: no attributes written onto another library's objects)."""
    model = torch.nn.Sequential(_layer(64, bias=True, dtype=torch.float32), torch.nn.ReLU())
    hooked = _layer(64, bias=False, dtype=torch.float32)
    hooked.register_forward_hook(lambda *a: None)
    model.append(hooked)
    original, keys = model[0], set(model.state_dict())
    before = dict(vars(original))
    assert prepare(model) == 1 and type(model[0]) is cpu_linear.Linear and type(model[2]) is torch.nn.Linear
    assert model[0].weight is original.weight and model[0].bias is original.bias and set(model.state_dict()) == keys
    assert type(original) is torch.nn.Linear and vars(original) == before
    with pytest.raises(TypeError, match="cpu_linear.packed"):
        prepare(original)


@needs_onednn
def test_gradients_flow_through_a_prepared_layer():
    layer = _layer(64, bias=True, dtype=torch.float32)
    layer = cpu_linear.packed(layer)
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(3, 64))
    assert layer.weight.grad is not None


def test_a_model_made_in_inference_mode_can_be_prepared():
    with torch.inference_mode():
        layer = _layer(64, bias=False, dtype=torch.float32)
        x = torch.randn(2, 64)
        plain = layer(x)
        layer = cpu_linear.packed(layer)
        torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pack", [False, pytest.param(True, marks=needs_onednn)])
def test_every_row_equals_the_row_alone_in_bf16(pack):
    layer = _layer(1536, bias=True)
    layer = cpu_linear.packed(layer, max_reduction=MAX_REDUCTION, pack=pack)
    assert layer.step == 768
    x = torch.randn(700, 1536).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
        for rows in (2, 8, 24, 64, 200, 700):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows


def test_the_split_layer_computes_the_same_linear_map():
    layer = _layer(3000, bias=True)
    x = torch.randn(5, 3000).to(torch.bfloat16)
    with torch.inference_mode():
        plain = layer(x).float()
        layer = cpu_linear.packed(layer, max_reduction=MAX_REDUCTION)
        split = layer(x).float()
    assert layer.step == 1000 and len(layer.packs.slices) == 3  # three equal slices, none over the limit
    assert torch.allclose(split, plain, rtol=0.02, atol=0.02)


def test_short_reductions_are_not_split_and_preparing_twice_changes_nothing():
    model = torch.nn.Sequential(_layer(MAX_REDUCTION, bias=False), torch.nn.ReLU(), _layer(MAX_REDUCTION + 1, bias=False))
    assert prepare(model, max_reduction=MAX_REDUCTION) == 2
    assert model[0].step == MAX_REDUCTION and model[2].step == 513
    assert prepare(model, max_reduction=MAX_REDUCTION) == 0


def _wide_llama(tokenizer):
    """A down_proj reducing over 1,536 inputs: split in bf16."""
    return tiny_model(tokenizer, "llama", intermediate_size=1536)


def test_the_engine_packs_on_cpu_and_splits_in_reduced_precision_only(tokenizer):
    bf16 = kvql.Model(_wide_llama(tokenizer).to(torch.bfloat16), tokenizer, cache_budget="4MB")
    fp32 = kvql.Model(_wide_llama(tokenizer), tokenizer, cache_budget="4MB")
    try:
        assert all(layer.mlp.down_proj.step == 768 for layer in bf16.hf_model.model.layers)
        assert all(layer.mlp.down_proj.step == 1536 for layer in fp32.hf_model.model.layers)  # not split
        # every layer packed, but those computed inside a stacked GEMM (fused_layers: q/k/v, gate/up)
        linears = [m for m in fp32.hf_model.modules() if isinstance(m, torch.nn.Linear)]
        stacked = {id(m) for m in fused_layers.stacked_parts(fp32.hf_model)}
        assert all(m.prepack == cpu_linear.can_pack() for m in linears if id(m) not in stacked)
        [c] = bf16.generate("hello", max_tokens=3, ignore_eos=True)
        assert len(c.token_ids) == 3
    finally:
        bf16.close()
        fp32.close()


def test_a_dtype_this_cpus_onednn_cannot_pack_runs_the_plain_kernel(monkeypatch):
    """On an AVX2-only CPU oneDNN raises when asked to pack bf16: such a layer must still compute its map."""
    monkeypatch.setattr(cpu_linear, "_packs", lambda dtype: dtype == torch.float32)
    layer = _layer(576, bias=True, dtype=torch.bfloat16)
    x = torch.randn(3, 576).to(torch.bfloat16)
    with torch.inference_mode():
        plain = layer(x)
        layer = cpu_linear.packed(layer)
        assert layer.packs.slices[0][1] is None
        stacked = cpu_linear.Stacked([layer, _layer(576, bias=False, dtype=torch.bfloat16, out_features=32)])
        assert stacked.packed.slices[0][1] is None
        ours, stacked_ours = layer(x).float(), stacked(x)[:, :96].float()
    torch.testing.assert_close(ours, plain.float(), rtol=0.02, atol=0.02)  # the bias added apart: its rounding
    torch.testing.assert_close(stacked_ours, plain.float(), rtol=0.02, atol=0.02)
