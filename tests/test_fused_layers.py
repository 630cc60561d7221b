"""Fused layer operations (kvql.engine.model.kernels.fused_ops) and the layers that use them (kvql.engine.model.fused_layers):
each kernel against the torch ops it replaces (RoPE bit for bit), each row independent of its batch, the
swapped model's forward against the original's for every supported family, stacked GEMMs following
edits of the weights, autograd and `restore` running transformers' own code again."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama

from conftest import tiny_model
from kvql.engine.model import cpu_linear, fused_layers
from kvql.engine.model.kernels import fused_ops

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
DTYPES = [torch.float32, torch.bfloat16]


def test_kernels_build_where_a_compiler_is():
    assert fused_ops.available(), fused_ops.LIBRARY.error


def _torch_rms_norm(x, w, eps):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_transformers(dtype):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 576, generator=g).to(dtype) * 3, torch.randn(576, generator=g).to(dtype)
    got, ref = fused_ops.rms_norm(x, w, 1e-5), _torch_rms_norm(x, w, 1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
    else:  # the normalized row rounds to bf16 as transformers': at most one bf16 step apart
        torch.testing.assert_close(got, ref, rtol=8e-3, atol=1e-5)
    strided = torch.randn(37, 2 * 576, generator=g).to(dtype)[:, 576:]  # rows may be strided
    assert torch.equal(fused_ops.rms_norm(strided, w, 1e-5), fused_ops.rms_norm(strided.contiguous(), w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 16])  # the vector path (half a head a multiple of 16) and the scalar one
def test_rope_is_bit_for_bit_transformers(dtype, d):
    g = torch.Generator().manual_seed(1)
    rows, heads, kv = 29, 9, 3
    qkv = torch.randn(rows, (heads + 2 * kv) * d, generator=g).to(dtype)
    freqs = (torch.arange(rows) * 7)[:, None].float() / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q = qkv[:, :heads * d].view(1, rows, heads, d).transpose(1, 2)
    k = qkv[:, heads * d:(heads + kv) * d].view(1, rows, kv, d).transpose(1, 2)
    ref_q, ref_k = modeling_llama.apply_rotary_pos_emb(q, k, cos[None], sin[None])
    out = qkv.clone()
    fused_ops.rope_(out, cos, sin, heads + kv, d)
    assert torch.equal(out[:, :heads * d].view(1, rows, heads, d).transpose(1, 2), ref_q)
    assert torch.equal(out[:, heads * d:(heads + kv) * d].view(1, rows, kv, d).transpose(1, 2), ref_k)
    assert torch.equal(out[:, (heads + kv) * d:], qkv[:, (heads + kv) * d:])  # values untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_matches_transformers(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(37, 640, generator=g).to(dtype) * 3, torch.randn(640, generator=g).to(dtype)
    norm = Gemma3RMSNorm(640, eps=1e-6).to(dtype)
    norm.weight.data.copy_(w)
    got, ref = fused_ops.rms_norm(x, w, 1e-6, plus_one=True), norm(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
    else:  # one rounding, of the product, as Gemma's: at most one bf16 step apart
        torch.testing.assert_close(got, ref, rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_mul_matches_torch(dtype, act):
    g = torch.Generator().manual_seed(2)
    gu = torch.randn(21, 2 * 1536, generator=g).to(dtype) * 4
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # far ends of the exp and its zero
    f = torch.nn.functional.silu if act == "silu" else lambda t: torch.nn.functional.gelu(t, approximate="tanh")
    ref = f(gu[:, :1536]) * gu[:, 1536:]
    tol = 2e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(fused_ops.gated_mul(gu, act), ref, rtol=tol, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_the_same_alone_and_in_a_batch(dtype):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(300, 576, generator=g).to(dtype), torch.randn(576, generator=g).to(dtype)
    gu = torch.randn(300, 2 * 1536, generator=g).to(dtype)  # 300 rows: the kernels run multithreaded
    for plus_one, act in ((False, "silu"), (True, "gelu_tanh")):
        norm, mul = fused_ops.rms_norm(x, w, 1e-6, plus_one), fused_ops.gated_mul(gu, act)
        for i in (0, 7, 151, 299):
            assert torch.equal(fused_ops.rms_norm(x[i:i + 1], w, 1e-6, plus_one), norm[i:i + 1])
            assert torch.equal(fused_ops.gated_mul(gu[i:i + 1], act), mul[i:i + 1])


def _logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swapped_model_computes_what_transformers_does(tokenizer, family, dtype):
    # head_dim 64 (SmolLM2's): the vector RoPE path; qwen2 has q/k/v biases, which the stacked GEMM adds
    hf = tiny_model(tokenizer, family, seed=5, hidden_size=128, num_attention_heads=2, num_key_value_heads=1).to(dtype)
    ids = torch.randint(0, len(tokenizer), (2, 23), generator=torch.Generator().manual_seed(4))
    before = _logits(hf, ids)
    assert fused_layers.prepare(hf) == 2 * (2 + 1 + 1) + 1  # per layer two norms, an MLP, an attention; final norm
    assert type(hf.model.layers[0].self_attn).__name__.startswith("Kvql")
    after = _logits(hf, ids)
    # float32: other rounding in the norm, the activation and the stacked GEMM, ~1e-5 of logits of ~10
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.1)
    torch.testing.assert_close(after, before, **tol)
    assert fused_layers.restore(hf) == 9
    assert type(hf.model.layers[0].self_attn).__name__ == type(hf.model.layers[0].self_attn).__name__.removeprefix("Kvql")
    assert torch.equal(_logits(hf, ids), before)  # transformers' own code again, bit for bit


@pytest.mark.parametrize("family", ["gemma", "gemma3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swapped_gemma_computes_what_transformers_does(tokenizer, family, dtype):
    """Gemma's (1 + w) RMSNorm and GELU-tanh gated MLP run the kernels; so does Gemma 3's attention, its q/k
    norms per head included."""
    import families as F

    model_type, overrides = F.FAMILIES[family]
    hf = F.build(model_type, overrides, len(tokenizer), tokenizer.eos_token_id, seed=5).to(dtype)
    ids = torch.randint(0, len(tokenizer), (2, 23), generator=torch.Generator().manual_seed(4))
    before = _logits(hf, ids)
    norms = 2 * (6 if family == "gemma3" else 2) + 1  # per layer two norms (Gemma 3: four and q/k norms); final
    assert fused_layers.prepare(hf) == norms + 2 * 1 + 2 * 1  # MLPs and attentions
    assert type(hf.model.layers[0].mlp).__name__.startswith("Kvql")
    assert type(hf.model.layers[0].self_attn).__name__.startswith("Kvql")
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.1)
    torch.testing.assert_close(_logits(hf, ids), before, **tol)
    fused_layers.restore(hf)
    assert torch.equal(_logits(hf, ids), before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swapped_qwen3_attention_computes_what_transformers_does(tokenizer, dtype):
    """Qwen3's attention (Llama-style q/k norms per head, before the rotary embedding) runs the kernels, in
    prompts of several rows (the q/k rows are copied out of the stacked GEMM's output) and one."""
    import families as F

    model_type, overrides = F.FAMILIES["qwen3"]
    hf = F.build(model_type, overrides, len(tokenizer), tokenizer.eos_token_id, seed=7).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.1)
    for shape in ((2, 19), (1, 1)):
        ids = torch.randint(0, len(tokenizer), shape, generator=torch.Generator().manual_seed(4))
        before = _logits(hf, ids)
        fused_layers.prepare(hf)
        assert type(hf.model.layers[1].self_attn).__name__ == "KvqlQwen3Attention"
        torch.testing.assert_close(_logits(hf, ids), before, **tol)
        fused_layers.restore(hf)
        assert torch.equal(_logits(hf, ids), before)


def test_a_subclass_whose_helper_method_differs_keeps_its_own_forward():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    class Other(Gemma3RMSNorm):
        def _norm(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 2 * self.eps)

    assert fused_layers.kind(Gemma3RMSNorm) == ("norm", True) and fused_layers.kind(Other) == (None, None)


def test_a_kernelized_attention_keeps_its_own_forward(tokenizer):
    """With the `kernels` package (transformers 5.25 requires it), a family's `apply_rotary_pos_emb` is a module
    object; unkernelized, the fused attention still applies (the swapped Gemma test above counts it); where
    `kernelize` put a hub kernel in a module's own wrapper (an instance forward), that module is left alone."""
    pytest.importorskip("kernels")
    import types

    hf = tiny_model(tokenizer)
    kernelized = hf.model.layers[0].self_attn
    wrapper = next(iter(kernelized._kernel_funcs.values()))
    wrapper.forward = types.MethodType(lambda self, q, k, cos, sin, unsqueeze_dim=1: (q, k), wrapper)
    fused_layers.prepare(hf)
    assert type(kernelized) is modeling_llama.LlamaAttention
    assert hasattr(type(hf.model.layers[1].self_attn), "kvql_original")


def test_stacked_gemm_follows_edits_and_replacements_of_its_parts(tokenizer):
    hf = tiny_model(tokenizer, "qwen2", seed=6)
    twin = tiny_model(tokenizer, "qwen2", seed=6)  # never swapped: what the edited model must compute
    ids = torch.randint(0, len(tokenizer), (1, 17), generator=torch.Generator().manual_seed(5))
    fused_layers.prepare(hf)
    _logits(hf, ids)  # packed now
    for model in (hf, twin):
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[1].mlp
        with torch.no_grad():
            attn.k_proj.weight.mul_(1.5)  # in place
            attn.v_proj.bias.add_(0.3)
        mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight.detach() * -1.0)  # replaced
    torch.testing.assert_close(_logits(hf, ids), _logits(twin, ids), rtol=1e-5, atol=1e-5)


def test_autograd_runs_transformers_code_and_reaches_every_projection(tokenizer):
    hf = tiny_model(tokenizer, "llama", seed=7)
    fused_layers.prepare(hf)
    ids = torch.randint(0, len(tokenizer), (1, 9), generator=torch.Generator().manual_seed(6))
    hf(input_ids=ids).logits.sum().backward()
    attn = hf.model.layers[0].self_attn
    assert all(p.weight.grad is not None for p in (attn.q_proj, attn.k_proj, attn.v_proj))


def test_engine_prepares_the_model_and_packs_the_stacked_parts_once(tokenizer, make_model):
    hf = tiny_model(tokenizer, "llama", seed=8)
    make_model(hf)
    attn = hf.model.layers[0].self_attn
    assert isinstance(fused_layers.stacked(attn), cpu_linear.Stacked)
    # the parts run inside the stacked GEMM: no packed copy of their own (memory as before)
    assert type(attn.q_proj) is torch.nn.Linear and type(attn.o_proj) is cpu_linear.Linear
    make_model(hf)  # a second engine on the same model changes nothing
    assert type(attn.q_proj) is torch.nn.Linear and fused_layers.stacked(hf.model.layers[0].self_attn) is \
        fused_layers.stacked(attn)


def test_a_copy_of_a_swapped_model_follows_its_own_weights(tokenizer):
    import copy

    hf = tiny_model(tokenizer, "llama", seed=9)
    fused_layers.prepare(hf)
    ids = torch.randint(0, len(tokenizer), (1, 11), generator=torch.Generator().manual_seed(7))
    before = _logits(hf, ids)
    twin = copy.deepcopy(hf)  # (kvql bench copies the engine's model for its baselines)
    assert fused_layers.stacked(twin.model.layers[0].self_attn).parts[0] is twin.model.layers[0].self_attn.q_proj
    assert torch.equal(_logits(twin, ids), before)
    with torch.no_grad():
        twin.model.layers[0].self_attn.q_proj.weight.mul_(-1.0)
    assert not torch.allclose(_logits(twin, ids), before) and torch.equal(_logits(hf, ids), before)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_without_fused_layers_gives_the_same_greedy_tokens(tokenizer, make_model, monkeypatch, family):
    """`KVQL_FUSED_OPS=0` (as where no compiler is) keeps transformers' layers; the answers stay."""
    from conftest import random_prompts

    prompts = random_prompts(seed=11, count=8, vocab=len(tokenizer), prefix_lengths=(0, 9))
    fused = make_model(tiny_model(tokenizer, family, seed=10))
    monkeypatch.setenv("KVQL_FUSED_OPS", "0")
    plain = make_model(tiny_model(tokenizer, family, seed=10))
    assert type(plain.hf_model.model.layers[0].self_attn).__name__ == f"{family.capitalize()}Attention"
    assert type(fused.hf_model.model.layers[0].self_attn).__name__.startswith("Kvql")
    assert ([c.token_ids for c in fused.generate(prompts, max_tokens=10)]
            == [c.token_ids for c in plain.generate(prompts, max_tokens=10)])


def test_kernels_build_into_kvql_cache_dir_and_export_their_limits(monkeypatch, tmp_path):
    from kvql.engine.model.kernels import build, paged_attention

    monkeypatch.setenv("KVQL_CACHE_DIR", str(tmp_path))
    assert build.cache_dir() == tmp_path / "kernels"
    build.load("fused_ops", ["-ffp-contract=off"])
    assert len(list((tmp_path / "kernels").glob("fused_ops-*.so"))) == 1
    assert paged_attention.available()
    assert paged_attention.LIBRARY.limits == {"kvql_max_group": 16, "kvql_max_dim": 576}  # read from the library
    assert not paged_attention.supports("cpu", torch.float32, 34, 2, 64)  # 17 query heads per KV head
    assert paged_attention.supports("cpu", torch.float32, 34, 1, 576)  # MQA: split by heads (MLA, absorbed)
    assert not paged_attention.supports("cpu", torch.float32, 4, 1, 577)


def test_a_replaced_norm_weight_is_followed(tokenizer):
    """A swapped module keeps its description between calls (`_described`), and describes itself again when a
    parameter it reads is replaced: norms, q/k norms and the MLP compute with the new weights."""
    import families as F

    model_type, overrides = F.FAMILIES["qwen3"]
    hf = F.build(model_type, overrides, len(tokenizer), tokenizer.eos_token_id, seed=8)
    twin = F.build(model_type, overrides, len(tokenizer), tokenizer.eos_token_id, seed=8)  # never swapped
    ids = torch.randint(0, len(tokenizer), (1, 13), generator=torch.Generator().manual_seed(5))
    fused_layers.prepare(hf)
    _logits(hf, ids)  # described now
    for model in (hf, twin):
        layer = model.model.layers[1]
        for norm in (layer.input_layernorm, layer.self_attn.q_norm):
            norm.weight = torch.nn.Parameter(norm.weight.detach() * 0.5 + 0.25)
    torch.testing.assert_close(_logits(hf, ids), _logits(twin, ids), rtol=1e-5, atol=1e-4)
