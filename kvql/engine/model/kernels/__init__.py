"""kvql's C kernels: their sources (`*.c`, `simd.h`), the build that compiles them once per machine
(`build`), and one Python module per library declaring its C signatures in one table and wrapping its
calls: `paged_attention` (attention over the KV pool in place), `fused_ops` (RMSNorm, rotary, gated
activations). Each is optional: without a compiler, or switched off, the engine runs torch ops instead
and gives the same tokens."""
