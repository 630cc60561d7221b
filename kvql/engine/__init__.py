"""The engine: radix KV cache, KV pool, scheduler, model runner, sampler.

oneDNN's instruction set is capped at AVX512_CORE_BF16 (`ONEDNN_MAX_CPU_ISA`, unless the environment sets it), before
any engine module runs oneDNN: on a CPU with AMX, oneDNN's bf16 GEMM otherwise takes AMX tiles, whose rounding
differs from the AVX512_BF16 path's, so a row's bits would depend on its batch size (bf16 batched != alone) and
kvql's small-batch kernel (kernels/gemv, which rounds as the AVX512_BF16 path) would be refused on every layer.
oneDNN reads the variable once, at its first primitive: a process that ran oneDNN before importing the engine keeps
what it had (cpu_linear then checks the kernel against oneDNN per weight, as everywhere). fp32 never takes AMX.
"""

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
