"""Decoder layers with fewer, larger operations on the CPU: `prepare(model)` swaps, in place, the class
of each supported attention, MLP and RMSNorm module for a subclass whose forward runs that module's steps
(`step`: the one description of what a layer computes, which the lean forward runs and compiles too):

- attention (`attention_steps`): one GEMM for the q, k and v projections (`cpu_linear.Stacked`), with per-head
  q/k norms (Qwen3's and Gemma 3's attention) each through `fused_ops.rms_norm` over rows of head_dim (the
  norm module's own weight, epsilon and form), the rotary embedding in place (`fused_ops.rope_`, bit for bit
  transformers'); then the model's cache and attention function exactly as transformers' forward calls them;
- gated MLP (`mlp_steps`): one GEMM for gate and up, `fused_ops.gated_mul` (SiLU, or GELU's tanh form:
  Gemma's), down;
- RMSNorm (`norm_step`): `fused_ops.rms_norm`, one pass (Llama's `w * x_norm`, or Gemma's `(1 + w) * x_norm`).

Why: per layer ~50 torch ops become ~15, and q/k/v's three narrow GEMMs one (docs/benchmarks.md,
forward_overhead). Nothing of kvql's hangs off transformers' modules: the stacked GEMMs live in a table keyed
by module (`stacked`); the swapped classes are kvql's own subclasses (`kvql_original`, `kvql_max_reduction`).

Where it applies, by structure rather than by name: a module whose class's forward is the same function as
that of Llama's, Qwen2's or Mistral's attention, Llama's MLP, or Llama's or Gemma's RMSNorm (`same_function`:
the same bytecode, constants and names, and every global it calls the same function in turn: transformers'
modular copies are; a copy that calls another `apply_rotary_pos_emb`, GLM's partial rotary, is not). Which
modules of each family it swaps: the README's family table (scripts/family_table.py counts them). Not (their
own forward runs): attention with q/k norms over the whole projection (OLMo 2), soft-capping or partial rotary,
MLPs with another activation (exact GELU: the kernels have no erf). Also: sizes that are multiples of 16, on a
CPU in float32 or bfloat16 with the kernels built and oneDNN's packed GEMM (`cpu_linear.can_pack()`). Any call
that is not that case (another device or dtype, autograd recording, training mode, batch rows whose positions
do not line up) runs transformers' own forward of the original class, unchanged. The swapped model is the same
object: its state dict, its parameters and any plain forward of it (the engine's uncached reference included)
go through the same layers, so the engine's exactness contract (cached == uncached) holds as before.
`restore(model)` swaps the original classes back.
"""

from __future__ import annotations

import inspect
import sys
import types
import weakref
from dataclasses import dataclass

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import cpu_linear, quantized, step
from .kernels import fused_ops


def _references():
    """kind -> [(reference class, the extra keywords its forward passes the attention function)]."""
    from transformers.models.gemma import modeling_gemma as gemma
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.mistral import modeling_mistral as mistral
    from transformers.models.gemma3 import modeling_gemma3 as gemma3
    from transformers.models.qwen2 import modeling_qwen2 as qwen2
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    return {
        "attention": [(llama.LlamaAttention, lambda m: {}),
                      (qwen2.Qwen2Attention, lambda m: {"sliding_window": m.sliding_window}),
                      (mistral.MistralAttention, lambda m: {"sliding_window": getattr(m.config, "sliding_window", None)})],
        # q and k each normalized per head (an RMSNorm over head_dim) before the rotary embedding
        "attention_qk_norm": [(qwen3.Qwen3Attention, lambda m: {"sliding_window": m.sliding_window}),
                              (gemma3.Gemma3Attention, lambda m: {"sliding_window": m.sliding_window})],
        "mlp": [(llama.LlamaMLP, None)],
        "norm": [(llama.LlamaRMSNorm, False), (gemma.GemmaRMSNorm, True)],  # plus_one
    }


def _hub_function(x):
    """The function behind `x` where `x` is the module object that transformers' `use_kernel_forward_from_hub`
    binds a function's name to when the `kernels` package is installed (transformers 5.25 requires it;
    `apply_rotary_pos_emb` of each family is one): unless a model was kernelized (`_kernelized`), its
    forward calls that function. Else `x`."""
    if not isinstance(x, torch.nn.Module) or "forward" in x.__dict__ or type(x).__name__ != "Func":
        return x
    wrapped = inspect.getclosurevars(type(x).forward).nonlocals.get("func")
    return wrapped if isinstance(wrapped, types.FunctionType) else x


def _kernelized(module: torch.nn.Module) -> bool:
    """Whether `kernels.kernelize` put a hub kernel in place of one of the module's functions (with
    `use_kernelized_func`, each instance holds its own wrappers in `_kernel_funcs`): its own forward runs."""
    return any("forward" in getattr(w, "__dict__", {}) for w in module.__dict__.get("_kernel_funcs", {}).values())


def same_function(f, g, _seen=None) -> bool:
    """Whether functions `f` and `g` compute the same thing as far as their code shows: equal bytecode,
    constants and names (after unwrapping decorators), and each global name they use bound to the same
    object in both, or to functions that are the same function in turn."""
    f, g = inspect.unwrap(f), inspect.unwrap(g)
    if f is g:
        return True
    if not (isinstance(f, types.FunctionType) and isinstance(g, types.FunctionType)):
        return False
    a, b = f.__code__, g.__code__
    if (a.co_code, a.co_consts, a.co_names) != (b.co_code, b.co_consts, b.co_names):
        return False
    seen = _seen if _seen is not None else set()
    if (a, b) in seen:
        return True
    seen.add((a, b))
    for name in a.co_names:
        x, y = _hub_function(f.__globals__.get(name, _MISSING)), _hub_function(g.__globals__.get(name, _MISSING))
        if x is y:
            continue
        if not (isinstance(x, types.FunctionType) and isinstance(y, types.FunctionType)
                and same_function(x, y, seen)):
            return False
    return True


_MISSING = object()
_KINDS: dict[type, tuple] = {}


def kind(cls: type) -> tuple[str | None, object]:
    """`(kind, detail)` of a module class: which reference forward it has (`same_function`), with the
    attention keywords of an attention or `plus_one` of a norm; `(None, None)` for none."""
    if cls not in _KINDS:
        _KINDS[cls] = (None, None)
        forward = getattr(cls, "forward", None)
        for k, refs in _references().items():
            match = next((extra for ref, extra in refs if forward is not None and same_function(forward, ref.forward)
                          and _same_methods(cls, ref, forward)), _MISSING)
            if match is not _MISSING:
                _KINDS[cls] = (k, match)
                break
    return _KINDS[cls]


def _same_methods(cls: type, ref: type, forward) -> bool:
    """The methods `forward` calls on self (`self._norm(...)`) are the same functions in both classes too."""
    for name in inspect.unwrap(forward).__code__.co_names:
        a, b = getattr(cls, name, None), getattr(ref, name, None)
        if isinstance(a, types.FunctionType) or isinstance(b, types.FunctionType):
            if not (isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType) and same_function(a, b)):
                return False
    return True


def _plain(x: torch.Tensor, module: torch.nn.Module) -> bool:
    """Whether this call must run the original forward (module doc)."""
    return (x.device.type != "cpu" or x.dtype not in fused_ops.DTYPES or module.training
            or (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters()))))


def original(module: torch.nn.Module) -> type:
    """The transformers class of `module` (the class `prepare` swapped out, or its own)."""
    return getattr(type(module), "kvql_original", type(module))


def _eps(norm: torch.nn.Module) -> float:
    """An RMSNorm module's epsilon, under the name its form gives it (Gemma's `eps`, Llama's `variance_epsilon`)."""
    return norm.eps if kind(original(norm))[1] else norm.variance_epsilon


def norm_step(norm: torch.nn.Module, src: str, dst: str) -> step.Norm:
    """An RMSNorm module `kind` knows, as a step: its weight, epsilon and form read now."""
    return step.Norm(src, dst, norm.weight.shape[0], norm.weight, _eps(norm), kind(original(norm))[1])


@dataclass(frozen=True)
class AttentionSteps:
    """A swapped attention module's steps from its input buffer to q, k and v: the stacked q/k/v GEMM, the
    per-head q/k norms where the attention has them, the rotary embedding in place; `q`, `k`, `v` the
    columns holding them after `project` ran (k and v of `kv_heads` heads, q of `heads`)."""
    project: list
    q: step.Cols
    k: step.Cols
    v: step.Cols
    heads: int
    kv_heads: int
    head_dim: int


def attention_steps(attn: torch.nn.Module, src: str) -> AttentionSteps:
    """`attn`'s steps (a module `prepare` swapped as an attention) reading buffer `src` (module doc)."""
    d = attn.head_dim
    heads, kv = attn.config.num_attention_heads, attn.config.num_key_value_heads
    project = [step.Gemm(src, "qkv", (heads + 2 * kv) * d, stacked(attn))]
    if kind(original(attn))[0] == "attention_qk_norm":
        project += [step.HeadNorm(step.Cols("qkv", 0, heads * d), "q", heads, d, norm_step(attn.q_norm, "", "")),
                    step.HeadNorm(step.Cols("qkv", heads * d, kv * d), "k", kv, d, norm_step(attn.k_norm, "", "")),
                    step.Rope("q", heads, d), step.Rope("k", kv, d)]
        q, k = step.Cols("q", 0, heads * d), step.Cols("k", 0, kv * d)
    else:  # q and k rotated in place in the GEMM's output
        project.append(step.Rope("qkv", heads + kv, d))
        q, k = step.Cols("qkv", 0, heads * d), step.Cols("qkv", heads * d, kv * d)
    return AttentionSteps(project, q, k, step.Cols("qkv", (heads + kv) * d, kv * d), heads, kv, d)


def mlp_steps(mlp: torch.nn.Module, src: str, dst: str, direct: bool = False) -> list:
    """A swapped gated MLP's steps: the stacked gate/up GEMM, the gated activation, down (`direct`: `step.Gemm`'s)."""
    n = mlp.gate_proj.out_features
    return [step.Gemm(src, "gate_up", 2 * n, stacked(mlp)), step.GatedAct("gate_up", "act", n, _activation(mlp)),
            step.Gemm("act", dst, mlp.down_proj.out_features, mlp.down_proj, direct)]


# activation module classes -> fused_ops.ACTIVATIONS (GELUTanh: gelu_pytorch_tanh; NewGELU: gelu_new, the same formula)
ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh"}


def _activation(mlp: torch.nn.Module) -> str:
    return ACTIVATIONS[type(mlp.act_fn).__name__]


_PARTS = {"attention": ("q_proj", "k_proj", "v_proj"), "attention_qk_norm": ("q_proj", "k_proj", "v_proj"),
          "mlp": ("gate_proj", "up_proj")}
_STACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stacked(module: torch.nn.Module) -> cpu_linear.Stacked | quantized.QuantizedStack:
    """The one GEMM of a swapped attention's q/k/v or MLP's gate/up projections, held here rather than on the
    module (transformers' modules carry nothing of kvql's). A copy of a swapped model (`copy.deepcopy`) gets
    its own at its first call, over its own parts, sliced as its class says (`prepare`). Quantized parts
    (`quantized.apply`, which quantizes such a group whole or not at all) stack as one quantized GEMM."""
    s = _STACKED.get(module)
    if s is None:
        parts = [getattr(module, name) for name in _PARTS[kind(original(module))[0]]]
        if all(isinstance(p, quantized.QuantizedLinear) for p in parts):
            s = _STACKED[module] = quantized.QuantizedStack(parts)
        else:
            s = _STACKED[module] = cpu_linear.Stacked(parts, type(module).kvql_max_reduction)
    return s


def stacked_parts(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linear layers of `model` that run inside a `stacked` GEMM (`cpu_linear.prepare` leaves them plain:
    the stacked copy is the only packed one)."""
    return [getattr(m, name) for m in model.modules() if hasattr(type(m), "kvql_original")
            for name in _PARTS.get(kind(type(m).kvql_original)[0], ())]


_DESCRIBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _described(module: torch.nn.Module, sources: tuple, describe):
    """`describe()` for a swapped module's forward, described again only when one of `sources` (the objects the
    description reads: its stacked GEMM, its norms' weights) is no longer the one it was described from (a
    parameter replaced), not at every call: a description costs as much as a small kernel."""
    hit = _DESCRIBED.get(module)
    if hit is None or len(hit[0]) != len(sources) or any(a is not b for a, b in zip(hit[0], sources)):
        hit = _DESCRIBED[module] = sources, describe()
    return hit[1]


class _Norm:
    def forward(self, hidden_states):
        if _plain(hidden_states, self) or self.weight.dtype != hidden_states.dtype or not hidden_states.is_contiguous():
            return super().forward(hidden_states)
        return _described(self, (self.weight, _eps(self)), lambda: norm_step(self, "", "")).apply(hidden_states)


class _MLP:
    def forward(self, x):
        if _plain(x, self):
            return super().forward(x)
        env = step.Env()
        env["x"] = x
        steps = _described(self, (stacked(self), self.down_proj, self.act_fn), lambda: mlp_steps(self, "x", "out"))
        return step.run(steps, env)["out"]


class _Attention:
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        shape = hidden_states.shape[:-1]
        cos, sin = position_embeddings if position_embeddings is not None else (None, None)
        if (_plain(hidden_states, self) or cos is None or cos.shape[:-1] != shape or cos.dtype != hidden_states.dtype
                or not cos.is_contiguous() or not sin.is_contiguous() or not self._kvql_fits(hidden_states)):
            return super().forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        norms = (self.q_norm.weight, self.k_norm.weight) if isinstance(self, _QKNormAttention) else ()
        steps = _described(self, (stacked(self), *norms), lambda: attention_steps(self, "h"))
        d = steps.head_dim
        env = step.Env()
        env["h"] = hidden_states.reshape(-1, hidden_states.shape[-1])
        env.cos, env.sin = cos.reshape(-1, d), sin.reshape(-1, d)
        step.run(steps.project, env)
        q, k, v = (env.cols(c).view(*shape, -1, d).transpose(1, 2) for c in (steps.q, steps.k, steps.v))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        original_class = self.kvql_original
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, sys.modules[original_class.__module__].eager_attention_forward)
        out, weights = interface(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                                 **kind(original_class)[1](self), **kwargs)
        return self.o_proj(out.reshape(*shape, -1).contiguous()), weights

    def _kvql_fits(self, x) -> bool:
        return True


class _QKNormAttention(_Attention):
    def _kvql_fits(self, x) -> bool:
        return self.q_norm.weight.dtype == x.dtype and self.k_norm.weight.dtype == x.dtype


_SWAPS: dict[tuple, type] = {}


def _swap(module: torch.nn.Module, mixin: type, max_reduction: int | None) -> None:
    cls = original(module)
    key = (cls, max_reduction)
    if key not in _SWAPS:
        _SWAPS[key] = type(f"Kvql{cls.__name__}", (mixin, cls),
                           {"kvql_original": cls, "kvql_max_reduction": max_reduction})
    module.__class__ = _SWAPS[key]


def prepare(model: torch.nn.Module, max_reduction: int | None = None) -> int:
    """Swap the supported modules of `model` (module doc); returns how many. Nothing when the kernels or
    oneDNN's packed GEMM are unavailable. Calling it again changes nothing but the GEMMs' slicing, when a
    `max_reduction` other than the last one's is asked."""
    if not (cpu_linear.can_pack() and fused_ops.available()):
        return 0
    swapped = 0
    for module in model.modules():
        if hasattr(type(module), "kvql_original"):
            if type(module).kvql_max_reduction != max_reduction:  # its GEMMs sliced as now asked
                _swap(module, type(module).__mro__[1], max_reduction)
                _STACKED.pop(module, None)
                _DESCRIBED.pop(module, None)
            continue
        if _kernelized(module):
            continue
        what = kind(type(module))[0]
        if what == "norm" and module.weight.shape[0] % 16 == 0:
            mixin = _Norm
        elif what == "mlp" and type(module.act_fn).__name__ in ACTIVATIONS and module.gate_proj.out_features % 16 == 0:
            mixin = _MLP
        elif what == "attention" and module.head_dim % 2 == 0:
            mixin = _Attention
        elif what == "attention_qk_norm" and module.head_dim % 16 == 0 and all(
                kind(original(n))[0] == "norm" for n in (module.q_norm, module.k_norm)):
            mixin = _QKNormAttention
        else:
            continue
        _swap(module, mixin, max_reduction)
        if mixin in (_MLP, _Attention, _QKNormAttention):
            for name in _PARTS[what]:
                if isinstance(getattr(module, name), cpu_linear.Linear):  # packed before on its own: plain again
                    setattr(module, name, cpu_linear.plain(getattr(module, name)))
            stacked(module)  # packed now, not at the first call
        swapped += 1
    return swapped


def restore(model: torch.nn.Module) -> int:
    """Undo `prepare`: the original classes back, the stacked GEMMs dropped. Returns how many modules."""
    restored = 0
    for module in model.modules():
        if hasattr(type(module), "kvql_original"):
            module.__class__ = type(module).kvql_original
            _STACKED.pop(module, None)
            _DESCRIBED.pop(module, None)
            restored += 1
    return restored
