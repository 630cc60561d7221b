"""The weights option of a local model (`kvql.model(weights=...)`, `--weights`): which quantized weights its linear
layers run on (kvql.engine.model.quantized does it), and what a spec and device allow.

- None (the default): the weights as loaded, in the model's dtype.
- `"gguf"`: a GGUF model's own blocks (the built-in models, a `.gguf` file as the spec).
- `"int8"` / `"int4"`: any model's linear weights quantized per group of 32 inputs.
CPU only.
"""

from __future__ import annotations

WEIGHTS = ("gguf", "int8", "int4")
HELP = ("linear layers on quantized weights (CPU): gguf: a GGUF model's own blocks (the built-in models, a .gguf "
        "file), as llama.cpp runs them; int8 / int4: any model quantized per group of 32 (default: the weights "
        "dequantized to --dtype)")


def check(spec: str, weights, device) -> None:
    """ValueError (one line) for a `weights` that cannot load `spec` on `device` (module doc)."""
    from .loader import BUILTIN

    if weights is None:
        return
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)} (or None: dequantized to dtype), got {weights!r}")
    if str(device) != "cpu":
        raise ValueError(f"weights={weights!r} runs on the CPU (kvql's quantized kernel); use device='cpu' or leave "
                         f"weights out")
    if weights == "gguf" and not (spec in BUILTIN or str(spec).endswith(".gguf")):
        raise ValueError(f"weights='gguf' runs a GGUF file's own blocks: model {spec!r} is no GGUF model (the built-in "
                         f"models or a path to a .gguf file are); weights='int8' or 'int4' quantizes any model")
