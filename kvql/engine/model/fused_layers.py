"""Decoder layers with fewer, larger operations on the CPU: `prepare(model)` swaps, in place, the class
of each supported attention, MLP and RMSNorm module for a subclass whose forward does the same
arithmetic in fewer steps:

- attention: one GEMM for the q, k and v projections (`cpu_linear.Stacked`), rotary embedding applied in
  place on its output (`fused_ops.rope_`, bit for bit transformers'), then the model's cache and attention
  function exactly as transformers' forward calls them; with per-head q/k norms (Qwen3's and Gemma 3's
  attention), q and k each through `fused_ops.rms_norm` over rows of head_dim (the norm module's own
  weight, epsilon and form) before the rotary embedding;
- gated MLP: one GEMM for gate and up, then `fused_ops.gated_mul` (SiLU, or GELU's tanh form: Gemma's),
  then down;
- RMSNorm: `fused_ops.rms_norm`, one pass (Llama's `w * x_norm`, or Gemma's `(1 + w) * x_norm`).

Measured (SmolLM2-135M, 2 threads, benchmarks/forward_overhead.py: batch-24 decode step at 330 tokens of
context, 24-prompt prefill): decode fp32 90 -> 75 ms, bf16 62 -> 53 ms; prefill fp32 672 -> 798 tok/s, bf16
1,342 -> 1,365 tok/s. Per layer ~50 torch ops become ~15, and q/k/v's three narrow GEMMs one.

Where it applies, by structure rather than by name: a module whose class's forward is the same function as
that of Llama's, Qwen2's or Mistral's attention, Llama's MLP, or Llama's or Gemma's RMSNorm (`same_function`: the same bytecode,
constants and names, and every global it calls the same function in turn: transformers' modular copies
are; a copy that calls another `apply_rotary_pos_emb`, GLM's partial rotary, is not). Which modules of
each family it swaps: the README's family table (scripts/family_table.py counts them). Not (their own
forward runs): attention with q/k norms over the whole projection (OLMo 2), soft-capping or partial rotary, MLPs
with another activation (exact GELU: the kernels have no erf). Also: sizes that are multiples of 16, on a CPU in float32 or bfloat16 with the
kernels built and oneDNN's packed GEMM (`cpu_linear.can_pack()`). Any call that is not that case (another
device or dtype, autograd recording, training mode, batch rows whose positions do not line up) runs
transformers' own forward of the original class, unchanged. The swapped model is the same object: its
state dict, its parameters and any plain forward of it (the engine's uncached reference included) go
through the same layers, so the engine's exactness contract (cached == uncached) holds as before.
`restore(model)` swaps the original classes back.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import cpu_linear
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


class _Norm:
    def forward(self, hidden_states):
        if _plain(hidden_states, self) or self.weight.dtype != hidden_states.dtype or not hidden_states.is_contiguous():
            return super().forward(hidden_states)
        plus_one = kind(self.kvql_original)[1]
        return fused_ops.rms_norm(hidden_states, self.weight, self.eps if plus_one else self.variance_epsilon, plus_one)


# activation module classes -> fused_ops.ACTIVATIONS (GELUTanh: gelu_pytorch_tanh; NewGELU: gelu_new, the same formula)
ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh"}


class _MLP:
    def forward(self, x):
        if _plain(x, self):
            return super().forward(x)
        return self.down_proj(fused_ops.gated_mul(self.kvql_gate_up(x), ACTIVATIONS[type(self.act_fn).__name__]))


class _Attention:
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        shape = hidden_states.shape[:-1]
        cos, sin = position_embeddings if position_embeddings is not None else (None, None)
        if (_plain(hidden_states, self) or cos is None or cos.shape[:-1] != shape or cos.dtype != hidden_states.dtype
                or not cos.is_contiguous() or not sin.is_contiguous() or not self._kvql_fits(hidden_states)):
            return super().forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        d = self.head_dim
        heads, kv = self.config.num_attention_heads, self.config.num_key_value_heads
        qkv = self.kvql_qkv(hidden_states.reshape(-1, hidden_states.shape[-1]))
        q, k = self._kvql_rotated(qkv, cos.reshape(-1, d), sin.reshape(-1, d), heads, kv, d)
        q, k, v = (x.view(*shape, -1, d).transpose(1, 2) for x in (q, k, qkv[:, (heads + kv) * d:]))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        original = self.kvql_original
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, sys.modules[original.__module__].eager_attention_forward)
        out, weights = interface(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                                 **kind(original)[1](self), **kwargs)
        return self.o_proj(out.reshape(*shape, -1).contiguous()), weights

    def _kvql_fits(self, x) -> bool:
        return True

    def _kvql_rotated(self, qkv, cos, sin, heads, kv, d):
        """q and k (views of `qkv`), rotated in place."""
        fused_ops.rope_(qkv, cos, sin, heads + kv, d)
        return qkv[:, :heads * d], qkv[:, heads * d:(heads + kv) * d]


class _QKNormAttention(_Attention):
    def _kvql_fits(self, x) -> bool:
        return self.q_norm.weight.dtype == x.dtype and self.k_norm.weight.dtype == x.dtype

    def _kvql_rotated(self, qkv, cos, sin, heads, kv, d):
        """q and k normalized per head (new rows), then rotated in place: as transformers' forward orders them."""
        t = qkv.shape[0]
        q = _head_norm(self.q_norm, qkv[:, :heads * d].reshape(t * heads, d)).view(t, heads * d)
        k = _head_norm(self.k_norm, qkv[:, heads * d:(heads + kv) * d].reshape(t * kv, d)).view(t, kv * d)
        fused_ops.rope_(q, cos, sin, heads, d)
        fused_ops.rope_(k, cos, sin, kv, d)
        return q, k


def _head_norm(norm: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """`norm` (an RMSNorm `kind` knows) over each row of `rows`, by `fused_ops.rms_norm`."""
    plus_one = kind(getattr(type(norm), "kvql_original", type(norm)))[1]
    return fused_ops.rms_norm(rows, norm.weight, norm.eps if plus_one else norm.variance_epsilon, plus_one)


_SWAPS: dict[type, type] = {}


def _swap(module: torch.nn.Module, mixin: type) -> None:
    original = type(module)
    if original not in _SWAPS:
        _SWAPS[original] = type(f"Kvql{original.__name__}", (mixin, original), {"kvql_original": original})
    module.__class__ = _SWAPS[original]


def prepare(model: torch.nn.Module, max_reduction: int | None = None) -> int:
    """Swap the supported modules of `model` (module doc); returns how many. Nothing when the kernels or
    oneDNN's packed GEMM are unavailable. Calling it again changes nothing."""
    if not (cpu_linear.can_pack() and fused_ops.available()):
        return 0
    swapped = 0
    for module in model.modules():
        for attr in ("kvql_qkv", "kvql_gate_up"):  # swapped before: its GEMMs sliced as now asked
            stacked = module.__dict__.get(attr)
            if stacked is not None and stacked.max_reduction != max_reduction:
                setattr(module, attr, cpu_linear.Stacked(stacked.parts, max_reduction))
        if hasattr(type(module), "kvql_original") or _kernelized(module):
            continue
        what = kind(type(module))[0]
        if what == "norm" and module.weight.shape[0] % 16 == 0:
            _swap(module, _Norm)
        elif what == "mlp" and type(module.act_fn).__name__ in ACTIVATIONS \
                and module.gate_proj.out_features % 16 == 0:
            module.kvql_gate_up = cpu_linear.Stacked([module.gate_proj, module.up_proj], max_reduction)
            _stack(module.gate_proj, module.up_proj)
            _swap(module, _MLP)
        elif what == "attention" and module.head_dim % 2 == 0:
            module.kvql_qkv = cpu_linear.Stacked([module.q_proj, module.k_proj, module.v_proj], max_reduction)
            _stack(module.q_proj, module.k_proj, module.v_proj)
            _swap(module, _Attention)
        elif what == "attention_qk_norm" and module.head_dim % 16 == 0 and all(
                kind(getattr(type(n), "kvql_original", type(n)))[0] == "norm" for n in (module.q_norm, module.k_norm)):
            module.kvql_qkv = cpu_linear.Stacked([module.q_proj, module.k_proj, module.v_proj], max_reduction)
            _stack(module.q_proj, module.k_proj, module.v_proj)
            _swap(module, _QKNormAttention)
        else:
            continue
        swapped += 1
    return swapped


def _stack(*parts: torch.nn.Linear) -> None:
    """The parts now run inside a `Stacked`: plain layers again (no packed copy of their own)."""
    for p in parts:
        if isinstance(p, cpu_linear.Linear):
            cpu_linear.restore(p)
        p.kvql_stacked = True


def restore(model: torch.nn.Module) -> int:
    """Undo `prepare`: the original classes back, the stacked GEMMs dropped. Returns how many modules."""
    restored = 0
    for module in model.modules():
        original = getattr(type(module), "kvql_original", None)
        if original is None:
            continue
        module.__class__ = original
        for name in ("kvql_qkv", "kvql_gate_up"):
            module.__dict__.pop(name, None)
        for part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            if hasattr(module, part):
                getattr(module, part).__dict__.pop("kvql_stacked", None)
        restored += 1
    return restored
