"""The engine: radix KV cache, KV pool, scheduler, model runner, sampler. This package is its one door: code
outside it imports the names below from `kvql.engine` and nothing beneath it (tests/test_layers.py checks).

- `Engine(hf_model, tokenizer, cache_budget=..., ...)` built from a byte budget (sizing.py), quantizing the model's
  linear layers first when asked (`weights`); `engine.requests` (a `RequestBuilder`) makes prompts and a
  `RequestSpec` into a request, `submit_all` queues it: `RequestGroup`s, each with its future; `SamplingParams`,
  `MaskFn`, `StopFn`: what a request carries.
- `UnsupportedModel` (a ValueError: why the engine cannot run a model), `check_config` (what a config alone rules
  out, before the weights load), `warm_up` (llguidance's view of a tokenizer, built ahead of the first constraint),
  `forcing` (a mask that forces given tokens), `plain_copy` (the model as transformers runs it).
- A GGUF file's weights: `GGUFFile` / `GGUFTensor` (its tensors as mapped views), `GGUF_BLOCK_TYPES` (the block
  types kvql's kernels run), `gguf_processor`, `gguf_names`, `dequantized_gguf`, `fill_from_gguf`, `qgemm_fits`.

The names load on first use (so that `import kvql.engine.x` inside the engine does not import all of it).

oneDNN's instruction set is capped at AVX512_CORE_BF16 (`ONEDNN_MAX_CPU_ISA`, unless the environment sets it), before
any engine module runs oneDNN: on a CPU with AMX, oneDNN's bf16 GEMM otherwise takes AMX tiles, whose rounding
differs from the AVX512_BF16 path's, so a row's bits would depend on its batch size (bf16 batched != alone) and
kvql's small-batch kernel (kernels/gemv, which rounds as the AVX512_BF16 path) would be refused on every layer.
oneDNN reads the variable once, at its first primitive: a process that ran oneDNN before importing the engine keeps
what it had (cpu_linear then checks the kernel against oneDNN per weight, as everywhere). fp32 never takes AMX.
"""

import importlib
import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

_DOOR = {
    "Engine": ("engine", "Engine"),
    "RequestGroup": ("request", "RequestGroup"), "RequestSpec": ("request", "RequestSpec"),
    "SamplingParams": ("request", "SamplingParams"), "MaskFn": ("request", "MaskFn"), "StopFn": ("request", "StopFn"),
    "UnsupportedModel": ("model.admission", "UnsupportedModel"), "check_config": ("model.admission", "check_config"),
    "warm_up": ("decode.grammar", "warm_up"), "forcing": ("decode.masks", "forcing"),
    "plain_copy": ("model.plain", "plain_copy"),
    "GGUFFile": ("model.gguf_blocks", "File"), "GGUFTensor": ("model.gguf_blocks", "Tensor"),
    "GGUF_BLOCK_TYPES": ("model.gguf_blocks", "TYPES"),
    "gguf_processor": ("model.gguf_weights", "gguf_processor"), "gguf_names": ("model.gguf_weights", "gguf_names"),
    "dequantized_gguf": ("model.gguf_weights", "dequantized"), "fill_from_gguf": ("model.gguf_weights", "fill"),
    "qgemm_fits": ("model.kernels.qgemm", "fits"),
}
__all__ = list(_DOOR)


def __getattr__(name: str):
    if name not in _DOOR:
        raise AttributeError(f"module 'kvql.engine' has no attribute {name!r}")
    module, attribute = _DOOR[name]
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    globals()[name] = value
    return value
