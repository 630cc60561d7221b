"""dtype everywhere: the names `kvql.model(dtype=)`, `kvql serve/run/bench --dtype` accept, the one default
(`auto`) of every command and of the Python API, and what `auto` picks."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

import kvql
from kvql.backends.dtype import DEFAULT, cpu_bf16_units, resolve


def test_names_aliases_and_torch_dtypes_resolve():
    assert resolve("float32") is torch.float32 and resolve("fp32") is torch.float32
    assert resolve("bfloat16") is torch.bfloat16 and resolve("BF16") is torch.bfloat16
    assert resolve("float16") is torch.float16 and resolve("torch.float16") is torch.float16
    assert resolve(torch.bfloat16, "cpu") is torch.bfloat16


def test_the_default_is_auto_bf16_on_cuda():
    assert DEFAULT == "auto"
    assert resolve(None, "cpu") is resolve("auto", "cpu")
    assert resolve(None, "cuda:0") is torch.bfloat16
    assert resolve("auto", "cuda") is torch.bfloat16


def test_every_command_and_the_python_api_share_one_dtype_default():
    # kvql run once loaded float32 where kvql serve loaded bfloat16: two models (and two disk cache directories)
    from kvql.cli import parser

    commands = parser()._subparsers._group_actions[0].choices
    for name in ("run", "serve", "bench", "generate", "demo"):
        (dtype,) = [a for a in commands[name]._actions if a.dest == "dtype"]
        assert dtype.default == DEFAULT, name
    assert inspect.signature(kvql.model).parameters["dtype"].default is None  # None: DEFAULT
    assert kvql.model("random", seed=7).hf_model.dtype is resolve(DEFAULT)


def test_auto_on_cpu_follows_the_cpus_bf16_units():
    assert resolve("auto", "cpu") is (torch.bfloat16 if cpu_bf16_units() else torch.float32)


def test_bf16_units_agree_with_the_kernels_cpu_flags():
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = set(f.read().split())
    expected = "AMX-BF16" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else None
    assert cpu_bf16_units() == expected


def test_an_unknown_dtype_names_the_accepted_ones():
    with pytest.raises(ValueError, match="'int8' is not one of auto, float32, bfloat16, float16"):
        resolve("int8")
    with pytest.raises(ValueError, match="not one of"):
        kvql.model("random", dtype="float64x")


def test_a_remote_model_refuses_dtype_instead_of_ignoring_it():
    with pytest.raises(TypeError, match="dtype= is for local models"):
        kvql.model("http://127.0.0.1:9/v1", dtype="bfloat16")


def test_a_bf16_model_computes_and_caches_in_bf16():
    m = kvql.model("random", seed=5, dtype="bfloat16")
    assert m.hf_model.dtype is torch.bfloat16 and m.engine.pool.k.dtype is torch.bfloat16
    [out] = m.generate("hello there", max_tokens=4, ignore_eos=True)
    assert len(out.token_ids) == 4
    assert kvql.model("random", seed=5, dtype="auto").hf_model.dtype is resolve("auto")
    m.engine.check_integrity()


def test_cli_dtype_reaches_the_loaded_model(tmp_path, llama, tokenizer):
    llama.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = subprocess.run([sys.executable, "-m", "kvql.cli", "generate", "hi", "--model", str(tmp_path / "model"),
                          "--dtype", "bfloat16", "--max-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "· bfloat16 ·" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "kvql.cli", "generate", "hi", "--dtype", "int8"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'int8'" in bad.stderr
