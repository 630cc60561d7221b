"""Quantized weights (issue 44): the qgemm kernel equals its plain C chain bit for bit and never depends on the rows
beside a row; GGUF's blocks decode to exactly the weights the `gguf` package dequantizes; a quantized model is exact
under the cache (greedy == its own forward's, cold and warm, on the ragged, lean and compiled paths) and batched ==
alone in bf16; the embedded SmolLM2 runs its own Q4_1 blocks; bad options say what is wrong."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

import families
import kvql
from conftest import random_prompts, reference_greedy
from kvql.engine.cache.fingerprint import fingerprint
from kvql.engine.cache.kv_pool import KVPool
from kvql.engine.model import gguf_blocks, quantized
from kvql.engine.model.kernels import qgemm
from kvql.engine.model.model_runner import ModelRunner, Segment, read_geometry

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
FORMATS = [(8, 32), (8, 16), (4, 32), (4, 16), (5, 32)]


def _weight(bits: int, group: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if bits == 8:
        q, mins = torch.randint(-128, 128, (n, k), generator=g), None
    else:
        q = torch.randint(0, 2**bits, (n, k), generator=g)
        q[0, 0] = 2**bits - 1  # the widest value: packed in `bits` bits, not fewer
        mins = (torch.randn(n, k // group, generator=g) * 0.01).half()
    scale = (torch.rand(n, k // group, generator=g) * 0.01).half()
    return q, scale, mins


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits,group", FORMATS)
def test_every_kernel_is_its_plain_chain_and_batch_invariant(bits, group, dtype):
    """Each kernel this machine runs (AVX512-VNNI, AVX2, both on an AVX-512 machine) equals the plain C chain."""
    n, k = 80, 96  # 5 blocks of 16 outputs (4 + 1 for one row, 2 + 2 + 1 for several), 3 groups of 32
    w = qgemm.QWeight.pack(*_weight(bits, group, n, k))
    assert w.bits == bits
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    kernels = qgemm.variants()
    assert qgemm.kernel() in kernels
    for library in kernels.values():
        for rows in (1, 2, 3, 4, 5, 9, 16, 19):  # AVX2 widens 4- and 5-bit weights once from 16 rows
            got = qgemm.qgemm(x[:rows], w, library=library)
            assert got.dtype == dtype and torch.equal(got, qgemm.qgemm(x[:rows], w, reference=True))
            assert all(torch.equal(got[i], qgemm.qgemm(x[i:i + 1], w, library=library)[0]) for i in range(rows))
    want = x.float() @ w.dequantized().T
    assert float((qgemm.qgemm(x, w).float() - want).abs().max() / want.abs().max()) < (1e-3 if dtype == torch.float32
                                                                                       else 1e-2)


def test_a_strided_row_and_odd_shapes():
    w = qgemm.QWeight.pack(*_weight(4, 32, 48, 64))
    x = torch.randn(3, 100)[:, 10:74]  # rows 100 apart
    assert torch.equal(qgemm.qgemm(x, w), qgemm.qgemm(x.contiguous(), w))
    for n, k in ((40, 64), (48, 48), (0, 64)):
        assert not qgemm.fits(n, k)
        with pytest.raises(ValueError):
            qgemm.QWeight.pack(torch.zeros(n, k, dtype=torch.int32), torch.ones(n, max(k // 32, 1)))


@pytest.mark.parametrize("bits,group", FORMATS)
def test_pack_keeps_every_value_and_scale(bits, group):
    q, scale, mins = _weight(bits, group, 32, 64)
    w = qgemm.QWeight.pack(q, scale, mins)
    assert torch.equal(w.values(), q.int()) and w.scale.dtype == torch.float16
    want = scale.float().repeat_interleave(group, 1) * q.float()
    if mins is not None:
        want = want + mins.float().repeat_interleave(group, 1)
    assert torch.equal(w.dequantized(), want)
    odd = scale.float() / 3  # not a float16: kept as float32, never rounded
    assert qgemm.QWeight.pack(q, odd, mins).scale.dtype == torch.float32
    two = qgemm.QWeight.cat([w, qgemm.QWeight.pack(*_weight(bits, group, 16, 64, seed=2))])
    assert two.n == 48 and torch.equal(two.dequantized()[:32], w.dequantized())
    with pytest.raises(ValueError, match="outside|5-bit weight .* in groups of 16"):  # 4-bit groups of 16: no 5-bit
        qgemm.QWeight.pack(q + (200 if bits == 8 else 32), scale, mins)


# bytes per block and where its float16 fields are (random bytes there could be NaN or infinite)
BLOCKS = {"Q8_0": (34, [0]), "Q5_0": (22, [0]), "Q5_1": (24, [0, 2]), "Q4_0": (18, [0]), "Q4_1": (20, [0, 2]),
          "Q5_K": (176, [0, 2]), "Q4_K": (144, [0, 2]), "Q6_K": (210, [208]), "Q3_K": (110, [108]),
          "Q2_K": (84, [80, 82]), "IQ4_NL": (18, [0]), "IQ4_XS": (136, [0])}
BITS = {"Q8_0": 8, "Q6_K": 8, "IQ4_NL": 8, "IQ4_XS": 8, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5}  # the others: 4


@pytest.mark.parametrize("kind", gguf_blocks.TYPES)
def test_gguf_blocks_decode_to_what_the_gguf_package_dequantizes(kind):
    import gguf.quants
    from gguf import GGMLQuantizationType

    n, k = 32, 512
    size, halves = BLOCKS[kind]
    per_block = 256 if kind in gguf_blocks.SUPER else 32
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (n, k // per_block, size), dtype=np.uint8)
    for at in halves:
        raw[..., at:at + 2] = (rng.standard_normal((n, k // per_block, 1)) * 0.01).astype(np.float16).view(np.uint8)
    raw = raw.reshape(n, -1)
    want = gguf.quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k).astype(np.float32)
    q, scale, mins = gguf_blocks.decode(kind, raw, k)
    w = qgemm.QWeight.pack(q, scale, mins)  # every type fits a qgemm format, losing nothing
    assert torch.equal(w.dequantized(), torch.from_numpy(want))
    assert w.bits == BITS.get(kind, 4)
    assert gguf_blocks.decode("TQ1_0", raw, k) is None


def _model(family: str, tokenizer, weights: str, dtype=torch.float32, **kw):
    model_type, overrides = families.FAMILIES[family]
    hf = families.build(model_type, overrides, len(tokenizer), eos_token_id=tokenizer.eos_token_id, seed=3).to(dtype)
    return kvql.Model(hf, tokenizer, weights=weights, cache_budget="16MB", **kw), hf


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3", "phi3", "falcon", "qwen3_moe", "mixtral"])
def test_a_quantized_model_is_exact_under_the_cache(family, weights, tokenizer):
    """Greedy tokens, cold and then served from the cache, equal the quantized model's own uncached forward: the
    ragged path with the lean forward (llama, qwen2 with its q/k/v bias, qwen3, gemma3), the ragged path through
    transformers' modules (phi3; the MoE families, their experts quantized too), the model's own forward over the
    pool (falcon)."""
    m, hf = _model(family, tokenizer, weights)
    try:
        assert m.quantization.startswith(f"weights {weights}: ") and "quantized" in m.quantization
        if family in ("qwen3_moe", "mixtral"):
            assert f"2 {weights} experts" in m.quantization, m.quantization
            assert not any(p.dim() == 3 for p in hf.parameters())
        assert any(isinstance(x, quantized.QuantizedLinear) for x in hf.modules())
        assert not any(type(x) is torch.nn.Linear for x in hf.modules()), m.quantization
        prompts = random_prompts(seed=2, count=8, vocab=len(tokenizer))
        want = [reference_greedy(hf, p, 10, tokenizer.eos_token_id) for p in prompts]
        assert [c.token_ids for c in m.generate(prompts, max_tokens=10)] == want
        again = m.generate(prompts, max_tokens=10)
        assert [c.token_ids for c in again] == want
        assert all(c.cached_tokens == c.prompt_tokens - 1 for c in again)
        m.check_integrity()
    finally:
        m.close()


@pytest.mark.parametrize("weights,family", [("int8", "llama"), ("int4", "llama"), ("int4", "qwen3_moe")])
def test_bf16_batched_equals_alone(weights, family, tokenizer):
    m, _ = _model(family, tokenizer, weights, torch.bfloat16, speculate=False)
    try:
        prompts = random_prompts(seed=5, count=10, vocab=len(tokenizer))
        together = [c.token_ids for c in m.generate(prompts, max_tokens=12)]
        m.clear_cache()
        assert [m.generate([p], max_tokens=12)[0].token_ids for p in prompts] == together
    finally:
        m.close()


@pytest.mark.parametrize("mixed", [False, True], ids=["stacked", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_compiled_step_runs_quantized_layers_bit_for_bit(dtype, mixed, tokenizer):
    """The lean forward's C step program calls qgemm (one stacked q/k/v and gate/up weight each; q/k/v in two
    formats, as Gemma 3's file has them: one call each into its columns): its logits and pool equal the module
    path's."""
    model_type, overrides = families.FAMILIES["llama"]
    hf = families.build(model_type, overrides, 256, eos_token_id=1).to(dtype)
    if mixed:
        other = families.build(model_type, overrides, 256, eos_token_id=1).to(dtype)
        quantized.apply(other, "int8")
    quantized.apply(hf, "int4")
    for i in range(len(hf.model.layers) if mixed else 0):  # v_proj in 8 bits, q and k in 4
        hf.model.layers[i].self_attn.v_proj = other.model.layers[i].self_attn.v_proj
    geometry = read_geometry(hf)
    pool = KVPool(num_layers=len(geometry.layers), kv_heads=geometry.kv_heads, head_dim=geometry.head_dim,
                  num_slots=128, dtype=dtype, device="cpu")
    runner = ModelRunner(hf, pool, geometry)
    lean = runner.lean
    assert lean is not None
    slots, empty = torch.arange(64), torch.empty(0, dtype=torch.long)

    def steps():
        pool.k.zero_(), pool.v.zero_()
        out = runner.forward([Segment(list(range(2, 22)), 0, empty, slots[:20], True, all_logits=True)])
        for n, t in ((20, 1), (21, 3), (24, 1)):
            out += runner.forward([Segment(list(range(30, 30 + t)), n, slots[:n], slots[n:n + t], True,
                                           all_logits=True)])
        return out, pool.k.clone()

    runner.lean = None
    want, k = steps()
    runner.lean = lean
    got, k2 = steps()
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(k, k2)
    assert lean._programs.get(1) is not None and lean._programs.get(3) is not None


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_tied_embedding_looks_up_the_quantized_head(weights):
    """LMQL's "random" model ties its embedding to its head: quantized, the embedding's rows are the head's
    dequantized rows, its float copy gone, and the model stays exact under the cache."""
    m = kvql.model("random", weights=weights, dtype="float32")
    hf = m.hf_model
    embed, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    assert isinstance(embed, quantized.TiedEmbedding) and embed.weight is None
    ids = torch.tensor([[3, 70, 49151]])
    assert torch.equal(embed(ids)[0], head.packed.dequantized()[ids[0]])
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 100, 200]]
    want = [reference_greedy(hf, p, 8, None) for p in prompts]
    for _ in range(2):
        assert [c.token_ids for c in m.generate(prompts, max_tokens=8, ignore_eos=True)] == want


def test_the_fingerprint_tells_a_quantized_model_from_its_float_twin(tokenizer):
    model_type, overrides = families.FAMILIES["llama"]
    a = families.build(model_type, overrides, 256, eos_token_id=1)
    b = families.build(model_type, overrides, 256, eos_token_id=1)
    pool = KVPool(num_layers=2, kv_heads=2, head_dim=16, num_slots=8, dtype=torch.float32, device="cpu")
    quantized.apply(b, "int8")
    assert fingerprint(a, tokenizer, pool, "x")["model"] != fingerprint(b, tokenizer, pool, "x")["model"]


def test_the_embedded_model_runs_its_own_q4_1_blocks():
    """SmolLM2's GGUF file: 210 Q4_1 layers and the tied head's Q8_0 embedding, the quantized layers near the
    file's size; greedy output equals the quantized model's own forward (transformers' generate), cold and warm."""
    m = kvql.model("smollm2-135m", dtype="float32", weights="gguf", cache_budget="256MB")
    try:
        assert "210 Q4_1, 1 Q8_0" in m.quantization and "left" not in m.quantization, m.quantization
        assert "the embedding looks up the head's rows" in m.quantization
        layers = sum(x.packed.nbytes() for x in m.hf_model.modules() if isinstance(x, quantized.QuantizedLinear))
        assert layers < 100 * 2**20
        # the float embedding dropped: what is left is the norms' few kB
        assert sum(p.numel() for p in m.hf_model.parameters()) < 100_000
        prompts = ["Q: What is the capital of France?\nA:", "The cat sat on the"]
        want = []
        with torch.inference_mode():
            for p in prompts:
                ids = m.tokenizer(p, return_tensors="pt").input_ids
                out = m.hf_model.generate(ids, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(ids))
                want.append(out[0, ids.shape[1]:].tolist())
        for _ in range(2):
            got = [c.token_ids for c in m.generate(prompts, max_tokens=16, ignore_eos=True)]
            assert got == want
    finally:
        m.close()


def test_bad_weights_options_say_what_is_wrong(tokenizer):
    with pytest.raises(ValueError, match="weights must be one of gguf, int8, int4"):
        kvql.model("random", weights="int3")
    for spec in (str(os.getcwd()), "random"):
        with pytest.raises(ValueError, match="is no GGUF model .*weights='int8' or 'int4' quantizes any model"):
            kvql.model(spec, weights="gguf")
    with pytest.raises(ValueError, match="runs on the CPU"):
        kvql.model("random", weights="int8", device="cuda")
    with pytest.raises(TypeError, match="weights= is for local models"):
        kvql.model("http://127.0.0.1:9/v1", weights="int8")
    with pytest.raises(ValueError, match="needs the model's GGUF file"):
        quantized.apply(families.build("llama", {}, 256, eos_token_id=1), "gguf")


def test_the_command_line_takes_weights():
    from kvql.backends.weights import WEIGHTS
    from kvql.cli import parser

    assert WEIGHTS == quantized.WEIGHTS
    assert parser().parse_args(["generate", "hi", "--weights", "int4"]).weights == "int4"
    with pytest.raises(SystemExit):
        parser().parse_args(["generate", "hi", "--weights", "q3"])


def test_speculation_the_disk_tier_the_gather_path_and_the_server_run_quantized(tokenizer, tmp_path, monkeypatch):
    """What works on float weights works on quantized ones: drafts verified several a step (the same tokens), the
    disk tier's files read back at the next start (the same tokens), the gather + SDPA attention path, kvql serve."""
    import httpx

    from conftest import serving
    from kvql.server.app import create_app

    model_type, overrides = families.FAMILIES["llama"]
    prompt = random_prompts(seed=11, count=1, vocab=len(tokenizer), prefix_lengths=(12,), suffix=(6, 7))[0]

    def fresh(**kw):
        hf = families.build(model_type, overrides, len(tokenizer), eos_token_id=tokenizer.eos_token_id, seed=3)
        return kvql.Model(hf, tokenizer, weights="int4", cache_budget="16MB", **kw), hf

    m, hf = fresh(disk_cache=tmp_path / "tier")
    want = reference_greedy(hf, prompt, 30, None)
    first = m.generate([prompt], max_tokens=30, ignore_eos=True)[0]
    again = m.generate([prompt], max_tokens=30, ignore_eos=True)[0]
    assert first.token_ids == again.token_ids == want and again.drafted_tokens > 10
    m.close()  # writes the tier
    m, _ = fresh(disk_cache=tmp_path / "tier")
    try:
        back = m.generate([prompt], max_tokens=30, ignore_eos=True)[0]
        assert back.token_ids == want and m.stats()["disk_tokens"] + m.stats()["ram_tokens"] > 0
        assert back.cached_tokens == len(prompt) - 1
        with serving(create_app(m, name="q")) as url:
            r = httpx.post(url + "/v1/completions", json={"model": "q", "prompt": prompt, "max_tokens": 30,
                                                           "temperature": 0, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == back.text
    finally:
        m.close()
    monkeypatch.setenv("KVQL_PAGED_ATTENTION", "0")
    m, hf = fresh()
    try:
        assert m.generate([prompt], max_tokens=30, ignore_eos=True)[0].token_ids == want
    finally:
        m.close()


def test_a_gguf_file_is_a_model_spec(tmp_path):
    """A `.gguf` path loads (transformers dequantizes it) and, with weights="gguf", runs its own blocks (the
    embedded SmolLM2's file), exact against its own forward."""
    from kvql.backends import loader

    path = loader.builtin_gguf("smollm2-135m", tmp_path)
    assert loader.resolve(str(path)) == path and loader.gguf_file(str(path)) == path
    m = kvql.model(str(path), dtype="float32", weights="gguf", cache_budget="64MB")
    try:
        assert "210 Q4_1, 1 Q8_0" in m.quantization
        ids = m.tokenizer("The capital of France is", return_tensors="pt").input_ids
        with torch.inference_mode():
            want = m.hf_model.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids))
        got = m.generate(["The capital of France is"], max_tokens=6, ignore_eos=True)[0].token_ids
        assert got == want[0, ids.shape[1]:].tolist()
    finally:
        m.close()


def test_a_slow_load_check_says_so_and_a_quick_one_does_not(tokenizer, monkeypatch, caplog):
    """The load check (a forward through every layer: minutes on the plain C kernel of a large model) says what
    it does once it has run a while, and how long it took; a quick one says nothing."""
    import logging
    import threading

    from kvql.engine import slow_notice
    from kvql.engine.model.model_runner import ModelRunner

    said = threading.Event()

    class Heard(logging.Handler):
        def emit(self, record):
            if "the load check" in record.getMessage():
                said.set()

    logging.getLogger("kvql").addHandler(heard := Heard())
    try:
        with caplog.at_level(logging.WARNING, logger="kvql"):
            m, _ = _model("llama", tokenizer, "int8")
            m.close()
        assert "load check" not in caplog.text
        checked = ModelRunner.verify

        def slow(self):  # the check outlasts SLOW_SECONDS: it ends once the notice was given
            checked(self)
            assert said.wait(60)

        monkeypatch.setattr(ModelRunner, "verify", slow)
        monkeypatch.setattr(slow_notice, "SLOW_SECONDS", 0.01)
        with caplog.at_level(logging.WARNING, logger="kvql"):
            m, _ = _model("llama", tokenizer, "int8")
            m.close()
    finally:
        logging.getLogger("kvql").removeHandler(heard)
    assert "(the load check) ..." in caplog.text and "(the load check): done in" in caplog.text
