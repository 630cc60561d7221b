"""Lean forward: a Llama-structured model's forward over the KV pool, layer by layer, without transformers'
module calls; the same kernels on the same tensors, so its logits equal the model's own forward's bit for bit.

Why: a decode step of one stream is a few hundred small calls around its GEMMs. Through transformers each layer
costs ~8 module calls (`nn.Module.__call__`, decorators, keyword plumbing), the attention interface lookup and
kvql's cache object besides the kernels' own wrappers: measured on SmolLM2-135M (fp32, 2 threads, batch-1
decode), ~17 ms of a ~40 ms step was not the GEMMs. The model runner calls `LeanModel.forward` instead of the
model wherever it applies (`build`), and the model's own forward everywhere else.

Where it applies, by structure (`build` returns None otherwise): the causal LM's forward, its base model's and
every decoder layer's forward are the same functions (`fused_layers.same_function`) as those of Llama, Qwen2 or
Mistral (the decoder layer: Llama's); every attention, MLP and RMSNorm of the layers and the final norm is one
that `fused_layers.prepare` swapped (no q/k norms, soft-capping or other activation: those keep transformers'
forward); the rotary embedding's forward is Llama's; no module has a hook. What the forward computes, in the
order transformers computes it: embedding; cos/sin from the rotary module; per layer RMSNorm, the stacked q/k/v
GEMM (its bias), rotary in place, K/V written to the pool slots, paged attention (`kernels.paged_attention`,
the layer's scaling and window), `o_proj`, the residual sum, RMSNorm, the stacked gate/up GEMM, the gated
activation, `down_proj`, the residual sum; the final norm; `lm_head` over the rows asked for.

Contract: `forward(ids [T], positions [T], write_slots [T], plan, rows)` on a CPU in float32 or bfloat16 with a
paged plan (`Plan.paged`), under inference mode: float32 logits `[len(rows), vocab]`, the pool written exactly as
the model's own forward writes it. `usable(dtype)` says whether a call in that dtype may take it (the swapped
modules' own condition: weights of that dtype).
"""

from __future__ import annotations

import torch

from . import cpu_linear, fused_layers
from .kernels import fused_ops, gemv, paged_attention


def _references() -> dict[str, list]:
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.mistral import modeling_mistral as mistral
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    return {"causal": [llama.LlamaForCausalLM, qwen2.Qwen2ForCausalLM, mistral.MistralForCausalLM],
            "model": [llama.LlamaModel, qwen2.Qwen2Model, mistral.MistralModel],
            "layer": [llama.LlamaDecoderLayer], "rotary": [llama.LlamaRotaryEmbedding]}


def _is(module, what: str) -> bool:
    forward = getattr(type(module), "forward", None)
    return forward is not None and any(fused_layers.same_function(forward, ref.forward)
                                       for ref in _references()[what])


def _swapped(module, what: str) -> bool:
    original = getattr(type(module), "kvql_original", None)
    return original is not None and fused_layers.kind(original)[0] == what


class _Layer:
    """One decoder layer's parts, read once (module doc)."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.eps1, self.eps2 = self.norm1.variance_epsilon, self.norm2.variance_epsilon
        self.qkv, self.o_proj = attn.kvql_qkv, attn.o_proj
        self.index = attn.layer_idx
        self.heads, self.kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling or self.head_dim ** -0.5
        self.window = fused_layers.kind(attn.kvql_original)[1](attn).get("sliding_window")
        self.gate_up, self.down_proj = mlp.kvql_gate_up, mlp.down_proj
        self.act = fused_layers.ACTIVATIONS[type(mlp.act_fn).__name__]


_UNBUILT = object()


class LeanModel:
    def __init__(self, hf_model):
        base = hf_model.model
        dtypes = {p.dtype for p in hf_model.parameters()}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else None  # an engine's model is not converted while it runs
        self.embed, self.rotary, self.norm = base.embed_tokens, base.rotary_emb, base.norm
        self.lm_head = hf_model.lm_head
        self.layers = [_Layer(layer) for layer in base.layers[:base.config.num_hidden_layers]]
        self._programs: dict[int, _Program | None] = {}

    def usable(self, dtype: torch.dtype) -> bool:
        """Whether a forward in `dtype` may take this path: every weight of the model was of that dtype when it
        was built."""
        return dtype == self.dtype and dtype in fused_ops.DTYPES

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor, plan,
                rows: torch.Tensor, pool) -> torch.Tensor:
        t = ids.shape[0]
        if t <= cpu_linear.GEMV_ROWS:
            threads = torch.get_num_threads()
            program = self._programs.get(t, _UNBUILT)
            if program is _UNBUILT or (program is not None and not program.current(threads)):
                # None (a layer without gemv's copies) stays None: which layers have them depends on shapes only
                program = self._programs[t] = _Program.build(self, t, pool, threads)
            if program is not None:
                return program.run(ids, positions, write_slots, plan.paged, rows)
        x = torch.nn.functional.embedding(ids, self.embed.weight)
        cos, sin = self.rotary(x[None], position_ids=positions[None])
        t = x.shape[0]
        segs = plan.paged
        for layer in self.layers:
            x = x + self._attention(layer, fused_ops.rms_norm(x, layer.norm1.weight, layer.eps1), cos, sin, t,
                                    pool.k[layer.index], pool.v[layer.index], write_slots, segs)
            h = fused_ops.rms_norm(x, layer.norm2.weight, layer.eps2)
            x = x + layer.down_proj.forward(fused_ops.gated_mul(layer.gate_up(h), layer.act))
        x = fused_ops.rms_norm(x, self.norm.weight, self.norm.variance_epsilon)
        return self.lm_head.forward(x.index_select(0, rows)).float()

    @staticmethod
    def _attention(layer: _Layer, h, cos, sin, t, k_pool, v_pool, write_slots, segs) -> torch.Tensor:
        d, heads, kv = layer.head_dim, layer.heads, layer.kv_heads
        qkv = layer.qkv(h)
        fused_ops.rope_(qkv, cos.view(t, d), sin.view(t, d), heads + kv, d)
        k_pool.index_copy_(1, write_slots, qkv[:, heads * d:(heads + kv) * d].view(t, kv, d).transpose(0, 1))
        v_pool.index_copy_(1, write_slots, qkv[:, (heads + kv) * d:].view(t, kv, d).transpose(0, 1))
        out = qkv.new_empty(t, heads, d)
        paged_attention.attend(qkv[:, :heads * d].view(t, heads, d).transpose(0, 1), k_pool, v_pool, out, segs,
                               layer.scaling, layer.window, None)
        return layer.o_proj.forward(out.view(t, heads * d))


def _gemm_parts(linear) -> tuple[list, torch.Tensor | None, object] | None:
    """`(slices, bias, packs)` of a `cpu_linear.Linear` or `Stacked` whose every reduction slice has gemv's blocked
    copy (what `_matmul` runs for a few rows), or None."""
    if isinstance(linear, cpu_linear.Stacked):
        packs = linear.packed
        if packs.source != linear._source():
            packs = linear.repack()
        bias = packs.bias
    elif isinstance(linear, cpu_linear.Linear):
        packs = linear.kvql_packed
        if packs.source != linear._source():
            packs = linear.repack()
        bias = linear.bias
    else:
        return None
    if not packs.slices or any(blocked is None for _, _, blocked in packs.slices):
        return None
    return packs.slices, bias, packs


def _current(linear, packs) -> bool:
    current = linear.packed if isinstance(linear, cpu_linear.Stacked) else linear.kvql_packed
    return current is packs and packs.source == linear._source()


class _Attend:
    """A layer's paged attention call: the arguments fixed for the program (`head`); a step adds its segments."""

    def __init__(self, head: tuple):
        self.head = head


class _Program:
    """A decode step of `rows` (<= GEMV_ROWS) tokens as the same kernels called directly with their arguments
    bound once: every GEMM through gemv's blocked copies (as `cpu_linear._matmul` runs a few rows), intermediate
    rows in this program's buffers (the residual stream, norm, q/k/v, attention, MLP rows), so a step makes ~13
    calls per layer instead of ~40 Python calls and allocations. The same operations in the same order as the
    module-level forward: the same results bit for bit. `current(threads)` is False once a weight changed or the
    thread count did (the program is built again)."""

    @classmethod
    def build(cls, lean: LeanModel, rows: int, pool, threads: int) -> _Program | None:
        linears = [x for layer in lean.layers for x in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj)]
        parts = [_gemm_parts(x) for x in linears]
        if any(p is None for p in parts) or rows > gemv.max_rows():
            return None
        return cls(lean, rows, pool, threads, linears, parts)

    def __init__(self, lean: LeanModel, rows: int, pool, threads: int, linears: list, parts: list):
        self.lean, self.rows, self.threads = lean, rows, threads
        self.watch = [(x, p[2]) for x, p in zip(linears, parts)]
        self.dtype, self.is_bf16 = lean.dtype, fused_ops.DTYPES[lean.dtype]
        fo, pa = fused_ops.LIBRARY.get(), paged_attention.LIBRARY.get()
        hidden = lean.embed.weight.shape[1]
        self.buffers = []  # the steps hold raw pointers into these
        self.x, self.h = self._buf(hidden), self._buf(hidden)
        self.slots = torch.empty(rows, dtype=torch.long)
        first = lean.layers[0]
        self.cos, self.sin = self._buf(first.head_dim), self._buf(first.head_dim)
        part = iter(parts)
        self.steps = []
        for layer in lean.layers:
            d, heads, kv = layer.head_dim, layer.heads, layer.kv_heads
            qkv, att, o = self._buf((heads + 2 * kv) * d), self._buf(heads * d), self._buf(hidden)
            k_pool, v_pool = pool.k[layer.index], pool.v[layer.index]
            query = qkv[:, :heads * d].view(rows, heads, d).transpose(0, 1)
            self.steps.append((fo.kvql_rms_norm, self._norm(self.x, layer.norm1.weight, layer.eps1)))
            self._gemm(self.h, next(part), qkv)
            self.steps.append((fo.kvql_rope, (qkv.data_ptr(), qkv.stride(0), rows, heads + kv, d, self.cos.data_ptr(),
                                              self.sin.data_ptr(), self.cos.stride(0), self.is_bf16, threads)))
            for pool_layer, a in ((k_pool, heads), (v_pool, heads + kv)):
                view = qkv[:, a * d:(a + kv) * d].view(rows, kv, d).transpose(0, 1)
                self.steps.append((pool_layer.index_copy_, (1, self.slots, view)))
            self.steps.append((pa.kvql_paged_attention, _Attend((
                query.data_ptr(), query.stride(1), query.stride(0), k_pool.data_ptr(), v_pool.data_ptr(),
                k_pool.stride(0), k_pool.stride(1), att.data_ptr(), att.stride(0), d, heads, kv, d, self.is_bf16,
                layer.scaling, int(layer.window or 0), 0.0))))
            self._gemm(att, next(part), o)
            self.steps.append((self.x.add_, (o,)))
            self.steps.append((fo.kvql_rms_norm, self._norm(self.x, layer.norm2.weight, layer.eps2)))
            gate_up = next(part)
            n = gate_up[0][0][2].shape[0] * 64
            gu, act, m = self._buf(n), self._buf(n // 2), self._buf(hidden)
            self._gemm(self.h, gate_up, gu)
            self.steps.append((fo.kvql_gated_mul, (gu.data_ptr(), gu.stride(0), act.data_ptr(), n // 2, rows, n // 2,
                                                   fused_ops.ACTIVATIONS[layer.act], self.is_bf16, threads)))
            self._gemm(act, next(part), m)
            self.steps.append((self.x.add_, (m,)))
        self.steps.append((fo.kvql_rms_norm, self._norm(self.x, lean.norm.weight, lean.norm.variance_epsilon)))

    def _buf(self, n: int) -> torch.Tensor:
        buf = torch.empty(self.rows, n, dtype=self.dtype)
        self.buffers.append(buf)
        return buf

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
        """`fused_ops.rms_norm(x, weight, eps)`'s arguments, into `self.h`."""
        n = x.shape[1]
        return (x.data_ptr(), x.stride(0), weight.data_ptr(), self.h.data_ptr(), n, x.shape[0], n, eps, 0, self.is_bf16,
                self.threads)

    def _gemm(self, x: torch.Tensor, part, out: torch.Tensor) -> None:
        """Steps computing `out = x @ w.T (+ bias)` as `cpu_linear._matmul` does for these rows: gemv per
        reduction slice, the slices added in order, then the bias."""
        for i, (a, _, blocked) in enumerate(part[0]):
            target = out if i == 0 else self._buf(out.shape[1])
            k = blocked.shape[1] * (2 if blocked.dim() == 4 else 1)
            self.steps.append((gemv.LIBRARY.get().kvql_gemv, (
                x.data_ptr() + a * x.element_size(), x.stride(0), blocked.data_ptr(), target.data_ptr(),
                target.stride(0), x.shape[0], blocked.shape[0] * 64, k, self.is_bf16, self.threads)))
            if i:
                self.steps.append((out.add_, (target,)))
        if part[1] is not None:
            self.steps.append((out.add_, (part[1],)))

    def current(self, threads: int) -> bool:
        return threads == self.threads and all(_current(x, packs) for x, packs in self.watch)

    def run(self, ids, positions, write_slots, segs, keep) -> torch.Tensor:
        lean = self.lean
        torch.index_select(lean.embed.weight, 0, ids, out=self.x)
        cos, sin = lean.rotary(self.x[None], position_ids=positions[None])
        self.cos.copy_(cos[0])
        self.sin.copy_(sin[0])
        self.slots.copy_(write_slots)
        tail = (segs.count, segs.q_start.data_ptr(), segs.q_len.data_ptr(), segs.key_start.data_ptr(),
                segs.n_keys.data_ptr(), segs.slots.data_ptr(), segs.max_keys, self.threads)
        for fn, args in self.steps:
            if type(args) is _Attend:
                if fn(*args.head, *tail):
                    raise RuntimeError("paged attention failed: out of memory")
            else:
                fn(*args)
        return lean.lm_head.forward(self.h.index_select(0, keep)).float()


def build(hf_model) -> LeanModel | None:
    """A `LeanModel` of `hf_model` (already through `fused_layers.prepare`), or None where the structure is not
    one it runs (module doc)."""
    if not (fused_ops.available() and paged_attention.available()):
        return None
    base = getattr(hf_model, "model", None)
    if base is None or not (_is(hf_model, "causal") and _is(base, "model")):
        return None
    embed = base.embed_tokens
    if type(embed) is not torch.nn.Embedding or embed.max_norm is not None:
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in hf_model.modules()) or _global_hooks():
        return None
    layers = list(base.layers[:base.config.num_hidden_layers])
    if not (layers and _is(base.rotary_emb, "rotary") and _swapped(base.norm, "norm")
            and fused_layers.kind(base.norm.kvql_original)[1] is False):
        return None
    for layer in layers:
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not (_is(layer, "layer") and _swapped(layer.self_attn, "attention") and _swapped(layer.mlp, "mlp")
                and all(_swapped(n, "norm") and fused_layers.kind(n.kvql_original)[1] is False for n in norms)):
            return None
    return LeanModel(hf_model)


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)
