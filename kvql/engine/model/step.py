"""A model's step described once: typed steps over named row buffers, and their one reference meaning.

A step reads and writes buffers named in an `Env` (each `[rows, width]`, one row per token of the step);
`run(steps, env)` runs a list of them with torch calls of kvql's kernels. Three forwards use the same lists:
a swapped transformers module runs its own module's steps (`fused_layers`), the lean forward runs a whole
model's (`lean_model._describe_layer`: per layer its steps, in the order transformers computes them), and the lean
forward's C step program is compiled from those lists (`lean_model._Program`), one kind of C call per step
type. So a change to how a layer computes is one edit here or in the description, and a new kind of layer
(a recurrent mixer with its state, latent K/V, attention sinks, chunks) is a new step type: its `run` here,
its compiled form in `_Program`.

Contract of every step: `run(env)` computes exactly what the transformers module it stands for computes
through kvql's kernels (`fused_ops`, `paged_attention`, `cpu_linear`), binding its `dst` to a new tensor, or
updating in place (`Rope` a buffer, `WriteKV` the pool); the compiled program calls the same kernels with the same
arguments in the same order, so all three forwards agree bit for bit. `width` of a step that writes a buffer
is that buffer's width, known when the step is described (the program allocates its buffers from it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import fused_ops, paged_attention


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


@dataclass(frozen=True)
class Rope:
    """The rotary embedding, in place, on the first `heads` heads of `buf` with the layer's `env.cos/sin`."""
    buf: str
    heads: int
    head_dim: int

    def run(self, env: Env) -> None:
        fused_ops.rope_(env[self.buf], env.cos, env.sin, self.heads, self.head_dim)


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


@dataclass(frozen=True)
class GatedAct:
    """`dst = act(gate) * up` of `src`'s two halves (the stacked gate/up GEMM's output)."""
    src: str
    dst: str
    width: int
    act: str

    def run(self, env: Env) -> None:
        env[self.dst] = fused_ops.gated_mul(env[self.src], self.act)


@dataclass(frozen=True)
class Add:
    """`dst = dst + src`: the residual sum."""
    dst: str
    src: str

    def run(self, env: Env) -> None:
        env[self.dst] = env[self.dst] + env[self.src]


Step = Norm | HeadNorm | Gemm | Rope | WriteKV | Attend | GatedAct | Add


def run(steps: list[Step], env: Env) -> Env:
    """Each step in order (module doc); returns `env`."""
    for step in steps:
        step.run(env)
    return env
