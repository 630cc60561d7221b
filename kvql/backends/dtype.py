"""The dtype a local model computes in: the names kvql accepts, the one default, and what it picks.

- `"auto"` (`DEFAULT`: of `kvql.model()` and of every command, `kvql run | serve | bench | generate |
  demo`, as vLLM's): bfloat16 on CUDA and on a CPU with native bf16 matrix units (AMX-BF16 or AVX-512
  BF16, read from the CPU's feature flags, never guessed from its name), float32 otherwise. One rule, so
  that the same spec gives the same model (and the same disk cache directory) whichever command loads it.
- `"float32"`: kvql's exact mode. Greedy output with the cache equals the uncached reference token for
  token (the tests prove it); ask for it by name where exactness matters (`dtype="float32"`,
  `--dtype float32`).
- `"bfloat16"`: 1.4-1.6x float32's speed on this project's CPU (AVX-512 BF16); greedy outputs may differ from the
  float32 ones (rounding), and with the chunking of a long prompt (see the README's "Exactness in each
  dtype").
- `"float16"`: for CUDA checkpoints saved in fp16.
- `None`: the default, `"auto"`.

`torch.dtype` objects and the aliases `fp32`, `bf16`, `fp16` are accepted too.
"""

from __future__ import annotations

DEFAULT = "auto"
NAMES = ("auto", "float32", "bfloat16", "float16")
_ALIASES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
            "float16": "float16", "fp16": "float16", "half": "float16"}


def cpu_bf16_units() -> str | None:
    """The CPU's native bf16 matrix unit (`"AMX-BF16"` or `"AVX-512 BF16"`), or None without one.

    Read from torch's own CPU feature probe (cpuinfo), falling back to /proc/cpuinfo's flags."""
    flags: dict = {}
    try:
        import torch

        flags = torch._C._cpu._get_cpu_capability()
    except (ImportError, AttributeError, RuntimeError):
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                words = set(f.read().split())
            flags = {"amx_bf16": "amx_bf16" in words, "avx512_bf16": "avx512_bf16" in words}
        except OSError:
            return None
    if flags.get("amx_bf16"):
        return "AMX-BF16"
    if flags.get("avx512_bf16"):
        return "AVX-512 BF16"
    return None


def resolve(value, device="cpu"):
    """`value` (a name above, an alias, a `torch.dtype` or None: `DEFAULT`) as the `torch.dtype` to load
    in on `device`. Raises ValueError naming the accepted values for anything else."""
    import torch

    if isinstance(value, torch.dtype):
        return value
    cuda = str(device).startswith("cuda")
    key = DEFAULT if value is None else str(value).lower().removeprefix("torch.")
    if key == "auto":
        return torch.bfloat16 if cuda or cpu_bf16_units() else torch.float32
    if key not in _ALIASES:
        raise ValueError(f"dtype {value!r} is not one of {', '.join(NAMES)} (or a torch.dtype)")
    return getattr(torch, _ALIASES[key])


def name(dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`."""
    return str(dtype).removeprefix("torch.")
