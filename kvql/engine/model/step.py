"""A model's step described once: typed steps over named row buffers, and their one reference meaning.

A step reads and writes buffers named in an `Env` (each `[rows, width]`, one row per token of the step);
`run(steps, env)` runs a list of them with torch calls of kvql's kernels. Three forwards use the same lists:
a swapped transformers module runs its own module's steps (`fused_layers`), the lean forward runs a whole
model's (`lean_model._describe_layer`: per layer its steps, in the order transformers computes them), and the lean
forward's C step program is compiled from those lists (`lean_model._Program`): each step type's `compile(p)`
adds its kernels' calls to program `p`, beside its `run`. So a change to how a layer computes is one edit here
or in the description, and a new kind of layer (a recurrent mixer with its state, latent K/V, attention sinks,
chunks) is one new class here: its `run` and its `compile`.

Contract of every step: `run(env)` computes exactly what the transformers module it stands for computes
through kvql's kernels (`fused_ops`, `paged_attention`, `cpu_linear`), binding its `dst` to a new tensor, or
updating in place (`Rope` a buffer, `WriteKV` the pool); the compiled program calls the same kernels with the same
arguments in the same order, so all three forwards agree bit for bit. `width` of a step that writes a buffer
is that buffer's width, known when the step is described (the program allocates its buffers from it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import cpu_linear, quantized
from .kernels import fused_ops, gemv, paged_attention, qgemm, step_program


@dataclass(frozen=True)
class Cols:
    """Columns `[start, start + width)` of buffer `buf`: q, k and v as views of one stacked GEMM's output."""
    buf: str
    start: int
    width: int


class Env(dict):
    """Buffer name -> tensor `[rows, width]`, plus what a layer's steps read besides: the rotation (`cos`,
    `sin`, `[rows, head_dim]`) of the layer being run, and for the pool steps the pool, the slots the new
    tokens are written to and the step's segments (`paged_attention.Segments`)."""

    def __init__(self, pool=None, slots: torch.Tensor | None = None, segs=None):
        super().__init__()
        self.pool, self.slots, self.segs = pool, slots, segs
        self.cos = self.sin = None

    def cols(self, c: Cols) -> torch.Tensor:
        x = self[c.buf]
        return x if c.start == 0 and c.width == x.shape[1] else x[:, c.start:c.start + c.width]


@dataclass(frozen=True)
class Norm:
    """`dst = rms_norm(src)`: Llama's `w * x_norm`, or Gemma's `(1 + w) * x_norm` (`plus_one`)."""
    src: str
    dst: str
    width: int
    weight: torch.Tensor
    eps: float
    plus_one: bool

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.rms_norm(x, self.weight, self.eps, self.plus_one)

    def run(self, env: Env) -> None:
        env[self.dst] = self.apply(env[self.src])

    def compile(self, p) -> None:
        _rms_norm(p, p.bound[self.src], self, p.out(self.dst, self.width))


@dataclass(frozen=True)
class HeadNorm:
    """`dst` = each of `heads` heads of `src` (`head_dim` columns each) through `norm`'s RMSNorm: Qwen3's and
    Gemma 3's q/k norms, applied before the rotary embedding."""
    src: Cols
    dst: str
    heads: int
    head_dim: int
    norm: Norm

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    def run(self, env: Env) -> None:
        x = env.cols(self.src)
        rows = x.reshape(x.shape[0] * self.heads, self.head_dim)
        env[self.dst] = self.norm.apply(rows).view(x.shape[0], self.width)

    def compile(self, p) -> None:
        """Per row, its heads as rows of head_dim (what `run`'s reshape hands the kernel)."""
        x, out, n, d = p.cols(self.src), p.out(self.dst, self.width), self.heads, self.head_dim
        for r in range(p.rows):
            _rms_norm(p, x[r:r + 1].view(n, d), self.norm, out[r:r + 1].view(n, d))


@dataclass(frozen=True)
class Gemm:
    """`dst = src @ w.T (+ bias)` by `linear`: a `cpu_linear.Stacked` (q/k/v or gate/up as one GEMM), a
    `cpu_linear.Linear` or a plain `nn.Linear`. `direct`: a module's `forward` is called, not the module (its
    hooks skipped: where the forward running the steps allows none, which saves `Module.__call__`'s cost)."""
    src: str
    dst: str
    width: int
    linear: object
    direct: bool = False

    def run(self, env: Env) -> None:
        linear = self.linear
        env[self.dst] = (linear.forward if self.direct else linear)(env[self.src])

    def compile(self, p) -> None:
        """`out = x @ w.T (+ bias)` as `cpu_linear._matmul` computes it for these rows: gemv per reduction slice,
        the slices added in order, then the bias; a quantized layer's: one qgemm call per weight into its columns,
        then the bias (as `quantized.QuantizedLinear` computes it). `p.gemms[id(self)]`: its `gemm_parts`."""
        x, gemm = p.bound[self.src], p.gemms[id(self)]
        out = p.out(self.dst, self.width)
        column = 0
        for w in gemm.weights if isinstance(gemm, QGemmParts) else ():  # quantized.linear's qgemm calls
            p.program.add("qgemm", qgemm.LIBRARY.get().kvql_qgemm, x.data_ptr(), x.stride(0), *qgemm.pointers(w),
                          out.data_ptr() + column * out.element_size(), out.stride(0), x.shape[0],
                          *qgemm.call_args(w), p.is_bf16, p.threads)
            column += w.n
        for i, (a, _, blocked) in enumerate(gemm.slices if isinstance(gemm, GemmParts) else ()):
            target = out if i == 0 else p.out("gemm.partial", self.width)
            n, k = gemv.shape(blocked)
            p.program.add("gemv", gemv.LIBRARY.get().kvql_gemv, x.data_ptr() + a * x.element_size(), x.stride(0),
                          blocked.data_ptr(), target.data_ptr(), target.stride(0), x.shape[0], n, k, p.is_bf16,
                          p.threads)
            if i:
                _add(p, out, target)
        if gemm.bias is not None:
            _add(p, out, gemm.bias)
        p.bound[self.dst] = out


@dataclass(frozen=True)
class Rope:
    """The rotary embedding, in place, on the first `heads` heads of `buf` with the layer's `env.cos/sin`."""
    buf: str
    heads: int
    head_dim: int

    def run(self, env: Env) -> None:
        fused_ops.rope_(env[self.buf], env.cos, env.sin, self.heads, self.head_dim)

    def compile(self, p) -> None:
        x = p.bound[self.buf]
        p.program.add("rope", p.fo.kvql_rope, x.data_ptr(), x.stride(0), p.rows, self.heads, self.head_dim,
                      p.cos.data_ptr(), p.sin.data_ptr(), p.cos.stride(0), p.is_bf16, p.threads)


@dataclass(frozen=True)
class WriteKV:
    """The new tokens' keys and values (`k`, `v`: `kv_heads` heads each) to pool layer `layer`, at
    `env.slots`: the prefix state a later step reads back from the cache."""
    k: Cols
    v: Cols
    layer: int
    kv_heads: int
    head_dim: int

    def run(self, env: Env) -> None:
        k, v = (env.cols(c) for c in (self.k, self.v))
        env.pool.write(self.layer, env.slots, *(x.view(x.shape[0], self.kv_heads, self.head_dim).transpose(0, 1)
                                               for x in (k, v)))

    def compile(self, p) -> None:
        """`KVPool.write`'s rows, by the program's own copy."""
        for pool_layer, c in ((p.pool.k[self.layer], self.k), (p.pool.v[self.layer], self.v)):
            source = p.cols(c)
            p.program.add("write_kv", None, pool_layer.data_ptr(), pool_layer.stride(0), pool_layer.stride(1),
                          source.data_ptr(), source.stride(0), p.slots.data_ptr(), p.rows, self.kv_heads,
                          self.head_dim, source.element_size())


@dataclass(frozen=True)
class Attend:
    """`dst` = attention of query `q` (`heads` heads) over pool layer `layer`'s keys and values of each
    segment (`paged_attention.attend`), with the layer's `scaling`, sliding `window`, score `softcap` and
    attention `sinks` (`[heads]` float32: a logit per head in each softmax's denominator)."""
    q: Cols
    dst: str
    layer: int
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    def run(self, env: Env) -> None:
        q = env.cols(self.q)
        t, d = q.shape[0], self.head_dim
        out = q.new_empty(t, self.heads, d)
        paged_attention.attend(q.view(t, self.heads, d).transpose(0, 1), env.pool.k[self.layer],
                               env.pool.v[self.layer], out, env.segs, self.scaling, self.window, self.softcap,
                               self.sinks)
        env[self.dst] = out.view(t, self.width)

    def compile(self, p) -> None:
        d, k_pool, v_pool = self.head_dim, p.pool.k[self.layer], p.pool.v[self.layer]
        query = p.cols(self.q).view(p.rows, self.heads, d).transpose(0, 1)
        out = p.out(self.dst, self.width)
        p.program.add("attention", p.pa.kvql_paged_attention,
                      query.data_ptr(), query.stride(1), query.stride(0), k_pool.data_ptr(), v_pool.data_ptr(),
                      k_pool.stride(0), k_pool.stride(1), out.data_ptr(), out.stride(0), d, self.heads, self.kv_heads,
                      d, p.is_bf16, step_program.f32(self.scaling), int(self.window or 0),
                      step_program.f32(self.softcap or 0.0), 0 if self.sinks is None else self.sinks.data_ptr(), 0)


@dataclass(frozen=True)
class GatedAct:
    """`dst = act(gate) * up` of `src`'s two halves (the stacked gate/up GEMM's output)."""
    src: str
    dst: str
    width: int
    act: str

    def run(self, env: Env) -> None:
        env[self.dst] = fused_ops.gated_mul(env[self.src], self.act)

    def compile(self, p) -> None:
        gu, act = p.bound[self.src], p.out(self.dst, self.width)
        p.program.add("gated_mul", p.fo.kvql_gated_mul, gu.data_ptr(), gu.stride(0), act.data_ptr(), self.width,
                      p.rows, self.width, fused_ops.ACTIVATIONS[self.act], p.is_bf16, p.threads)


@dataclass(frozen=True)
class Add:
    """`dst = dst + src`: the residual sum."""
    dst: str
    src: str

    def run(self, env: Env) -> None:
        env[self.dst] = env[self.dst] + env[self.src]

    def compile(self, p) -> None:
        _add(p, p.bound[self.dst], p.bound[self.src])


Step = Norm | HeadNorm | Gemm | Rope | WriteKV | Attend | GatedAct | Add


def run(steps: list[Step], env: Env) -> Env:
    """Each step in order (module doc); returns `env`."""
    for step in steps:
        step.run(env)
    return env


def _rms_norm(p, x: torch.Tensor, norm: Norm, out: torch.Tensor) -> None:
    """`out = norm(x)` over the rows of `x` (`fused_ops.rms_norm`'s call), in program `p`."""
    p.program.add("rms_norm", p.fo.kvql_rms_norm, x.data_ptr(), x.stride(0), norm.weight.data_ptr(),
                  out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], step_program.f32(norm.eps),
                  int(norm.plus_one), p.is_bf16, p.threads)


def _add(p, out: torch.Tensor, y: torch.Tensor) -> None:
    """out += y in program `p` (rows of out's width; a 1-D y is added to every row: a bias)."""
    p.program.add("add", None, out.data_ptr(), out.stride(0), y.data_ptr(), y.stride(0) if y.dim() == 2 else 0,
                  out.shape[0], out.shape[1], p.is_bf16)


class GemmParts(NamedTuple):
    """What `cpu_linear._matmul` runs for a few rows of a `Linear` or `Stacked`: its reduction slices (each with
    gemv's blocked copy), its bias, and the packed set they came from (`current` checks it)."""
    slices: list
    bias: torch.Tensor | None
    packs: object


class QGemmParts(NamedTuple):
    """What a `quantized.QuantizedLinear` or `QuantizedStack` runs: its quantized weights (a stack's parts in
    different formats: one each, side by side in the output), its bias."""
    weights: list[qgemm.QWeight]
    bias: torch.Tensor | None
    source: list = []  # nothing to watch: quantized weights are not edited (cpu_linear.unchanged([]) is True)


def gemm_parts(linear) -> GemmParts | QGemmParts | None:
    """A `cpu_linear.Linear` or `Stacked`'s `GemmParts` (None where a slice has no blocked copy), or a quantized layer's
    `QGemmParts`."""
    if isinstance(linear, quantized.QuantizedLinear):
        return QGemmParts([linear.packed], linear.bias)
    if isinstance(linear, quantized.QuantizedStack):
        return QGemmParts(linear.weights, linear.bias)
    if not isinstance(linear, (cpu_linear.Linear, cpu_linear.Stacked)):
        return None
    packs = linear.current_packs()
    if not packs.slices or any(blocked is None for _, _, blocked in packs.slices):
        return None
    return GemmParts(packs.slices, packs.bias if isinstance(linear, cpu_linear.Stacked) else linear.bias, packs)
