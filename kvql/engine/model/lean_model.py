"""Lean forward: a model's forward over the KV pool, layer by layer, without transformers' module calls; the same
kernels on the same tensors, so its logits equal the model's own forward's bit for bit.

Why: a decode step of one stream is a few hundred small calls around its GEMMs. Through transformers each layer
costs ~8 module calls (`nn.Module.__call__`, decorators, keyword plumbing), the attention interface lookup and
kvql's cache object besides the kernels' own wrappers: measured on SmolLM2-135M (fp32, 2 threads, batch-1
decode), ~17 ms of a ~40 ms step was not the GEMMs. The model runner calls `LeanModel.forward` instead of the
model wherever it applies (`build`), and the model's own forward everywhere else.

Where it applies, by structure (`build` returns None otherwise), two of them:
- Llama's: the causal LM's and base model's forwards the same functions (`fused_layers.same_function`) as
  Llama's, Qwen2's, Mistral's or Qwen3's, every decoder layer's Llama's, the rotary embedding's Llama's;
- Gemma 3's: the causal LM's, base model's, decoder layers', rotary embedding's and scaled embedding's forwards
  Gemma 3's (text), attention causal (not `use_bidirectional_attention`);
and in both every attention, MLP and RMSNorm of the layers and the final norm one that `fused_layers.prepare`
swapped, and no module with a hook. What the forward computes, in the order transformers computes it: the
embedding (Gemma 3: times its scale); cos/sin from the rotary module (Gemma 3: per layer type); per layer the
input RMSNorm, the stacked q/k/v GEMM (its bias), the q/k norms per head where the attention has them, rotary
in place, K/V written to the pool slots, paged attention (`kernels.paged_attention`, the layer's scaling and
window), `o_proj` (Gemma 3: its post-attention norm), the residual sum, the MLP's norm, the stacked gate/up
GEMM, the gated activation, `down_proj` (Gemma 3: its post-feedforward norm), the residual sum; the final norm;
`lm_head` over the rows asked for (Gemma 3: the final logit soft-cap where the config has one).

Contract: `forward(ids [T], positions [T], write_slots [T], plan, rows)` on a CPU in float32 or bfloat16 with a
paged plan (`Plan.paged`), under inference mode: float32 logits `[len(rows), vocab]`, the pool written exactly as
the model's own forward writes it. `usable(dtype)` says whether a call in that dtype may take it (the swapped
modules' own condition: weights of that dtype). The model's parts are read once, when it is built: weights edited
in place are followed (the bound programs are built again when a GEMM's weight or bias changes:
`cpu_linear.unchanged`, checked each step), other parameters replaced by other tensors are not (an engine's model is not converted or reloaded while it runs).
"""

from __future__ import annotations

import torch

from . import cpu_linear, fused_layers
from .kernels import fused_ops, gemv, paged_attention, step_program


def _references() -> dict[str, dict[str, list]]:
    """structure -> part -> reference classes whose forward that part's must be."""
    from transformers.models.gemma3 import modeling_gemma3 as gemma3
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.mistral import modeling_mistral as mistral
    from transformers.models.qwen2 import modeling_qwen2 as qwen2
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    return {
        "llama": {"causal": [llama.LlamaForCausalLM, qwen2.Qwen2ForCausalLM, mistral.MistralForCausalLM,
                             qwen3.Qwen3ForCausalLM],
                  "model": [llama.LlamaModel, qwen2.Qwen2Model, mistral.MistralModel, qwen3.Qwen3Model],
                  "layer": [llama.LlamaDecoderLayer], "rotary": [llama.LlamaRotaryEmbedding],
                  "embedding": [torch.nn.Embedding]},
        "gemma3": {"causal": [gemma3.Gemma3ForCausalLM], "model": [gemma3.Gemma3TextModel],
                   "layer": [gemma3.Gemma3DecoderLayer], "rotary": [gemma3.Gemma3RotaryEmbedding],
                   "embedding": [gemma3.Gemma3TextScaledWordEmbedding]},
    }


def _is(module, refs: list) -> bool:
    forward = getattr(type(module), "forward", None)
    return forward is not None and any(fused_layers.same_function(forward, ref.forward) for ref in refs)


def _swapped(module, *what: str) -> bool:
    original = getattr(type(module), "kvql_original", None)
    return original is not None and fused_layers.kind(original)[0] in what


class _Norm:
    """An RMSNorm module's weight, epsilon and form (`plus_one`: Gemma's `(1 + w)`), as its swapped forward uses."""

    def __init__(self, norm):
        self.weight = norm.weight
        self.plus_one = fused_layers.kind(type(norm).kvql_original)[1]
        self.eps = norm.eps if self.plus_one else norm.variance_epsilon

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.rms_norm(x, self.weight, self.eps, self.plus_one)


class _Layer:
    """One decoder layer's parts, read once (module doc). `post_attention` / `post_mlp`: Gemma 3's norms of the
    attention's and the MLP's outputs (None: Llama's)."""

    def __init__(self, layer, gemma: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn
        self.norm_in = _Norm(layer.input_layernorm)
        self.post_attention = _Norm(layer.post_attention_layernorm) if gemma else None
        self.norm_mlp = _Norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm)
        self.post_mlp = _Norm(layer.post_feedforward_layernorm) if gemma else None
        self.qk_norms = (_Norm(attn.q_norm), _Norm(attn.k_norm)) if _swapped(attn, "attention_qk_norm") else None
        self.layer_type = getattr(attn, "layer_type", None) if gemma else None
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
    def __init__(self, hf_model, gemma: bool):
        base = hf_model.model
        dtypes = {p.dtype for p in hf_model.parameters()}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else None  # an engine's model is not converted while it runs
        self.embed, self.rotary, self.norm = base.embed_tokens, base.rotary_emb, _Norm(base.norm)
        self.embed_scale = base.embed_tokens.embed_scale if gemma else None
        self.softcap = getattr(hf_model.config, "final_logit_softcapping", None) if gemma else None
        self.lm_head = hf_model.lm_head
        self.layers = [_Layer(layer, gemma) for layer in base.layers[:base.config.num_hidden_layers]]
        self.layer_types = sorted({layer.layer_type for layer in self.layers}, key=str)
        self._programs: dict[int, _Program | None] = {}

    def usable(self, dtype: torch.dtype) -> bool:
        """Whether a forward in `dtype` may take this path: every weight of the model was of that dtype when it
        was built."""
        return dtype == self.dtype and dtype in fused_ops.DTYPES

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.embedding(ids, self.embed.weight)
        return x if self.embed_scale is None else x * self.embed_scale.to(self.embed.weight.dtype)

    def rotations(self, x: torch.Tensor, positions: torch.Tensor) -> dict:
        """layer type -> (cos, sin) `[T, head_dim]` (one entry, None, for Llama's structure)."""
        out = {}
        for layer_type in self.layer_types:
            args = () if layer_type is None else (layer_type,)
            cos, sin = self.rotary(x[None], positions[None], *args)
            out[layer_type] = cos[0], sin[0]
        return out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.forward(h)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor, plan,
                rows: torch.Tensor, pool) -> torch.Tensor:
        t = ids.shape[0]
        if t <= cpu_linear.gemv_rows(self.dtype):
            threads = torch.get_num_threads()
            program = self._programs.get(t, _UNBUILT)
            if program is _UNBUILT or (program is not None and not program.current(threads)):
                # None (a layer without gemv's copies) stays None: which layers have them depends on shapes only
                program = self._programs[t] = _Program.build(self, t, pool, threads)
            if program is not None:
                return program.run(ids, positions, write_slots, plan.paged, rows)
        x = self.embedding(ids)
        rotations = self.rotations(x, positions)
        for layer in self.layers:
            a = self._attention(layer, layer.norm_in(x), *rotations[layer.layer_type], pool.k[layer.index],
                                pool.v[layer.index], write_slots, plan.paged)
            x = x + (a if layer.post_attention is None else layer.post_attention(a))
            m = layer.down_proj.forward(fused_ops.gated_mul(layer.gate_up(layer.norm_mlp(x)), layer.act))
            x = x + (m if layer.post_mlp is None else layer.post_mlp(m))
        return self.logits(self.norm(x).index_select(0, rows))

    @staticmethod
    def _attention(layer: _Layer, h, cos, sin, k_pool, v_pool, write_slots, segs) -> torch.Tensor:
        t, d, heads, kv = h.shape[0], layer.head_dim, layer.heads, layer.kv_heads
        qkv = layer.qkv(h)
        q, k = layer.attn._kvql_rotated(qkv, cos, sin, heads, kv, d)  # the swapped module's own steps
        k_pool.index_copy_(1, write_slots, k.view(t, kv, d).transpose(0, 1))
        v_pool.index_copy_(1, write_slots, qkv[:, (heads + kv) * d:].view(t, kv, d).transpose(0, 1))
        out = qkv.new_empty(t, heads, d)
        paged_attention.attend(q.view(t, heads, d).transpose(0, 1), k_pool, v_pool, out, segs, layer.scaling,
                               layer.window, None)
        return layer.o_proj.forward(out.view(t, heads * d))


def _gemm_parts(linear) -> tuple[list, torch.Tensor | None, object] | None:
    """`(slices, bias, packs)` of a `cpu_linear.Linear` or `Stacked` whose every reduction slice has gemv's blocked
    copy (what `_matmul` runs for a few rows), or None."""
    if not isinstance(linear, (cpu_linear.Linear, cpu_linear.Stacked)):
        return None
    packs = linear.current_packs()
    if not packs.slices or any(blocked is None for _, _, blocked in packs.slices):
        return None
    return packs.slices, packs.bias if isinstance(linear, cpu_linear.Stacked) else linear.bias, packs


class _Program:
    """A decode step of `rows` (<= `cpu_linear.gemv_rows`) tokens as the same kernels called directly with their arguments
    bound once: every GEMM through gemv's blocked copies (as `cpu_linear._matmul` runs a few rows), intermediate
    rows in this program's buffers (the residual stream, norms, q/k/v, attention, MLP rows), the list run by one C
    call (`kernels/step_program.py`) instead of ~40 Python calls and allocations per layer. The same operations in
    the same order as the module-level forward: the same results bit for bit. `current(threads)` is False once a weight changed or the
    thread count did (the program is built again)."""

    @classmethod
    def build(cls, lean: LeanModel, rows: int, pool, threads: int) -> _Program | None:
        linears = [x for layer in lean.layers for x in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj)]
        parts = [_gemm_parts(x) for x in linears]
        if any(p is None for p in parts) or rows > gemv.max_rows() or not step_program.available():
            return None
        return cls(lean, rows, pool, threads, parts)

    def __init__(self, lean: LeanModel, rows: int, pool, threads: int, parts: list):
        self.lean, self.rows, self.threads = lean, rows, threads
        self.sources = [p[2].source for p in parts]  # what the packed copies were made from
        self.dtype, self.is_bf16 = lean.dtype, fused_ops.DTYPES[lean.dtype]
        self.fo, pa = fused_ops.LIBRARY.get(), paged_attention.LIBRARY.get()
        hidden = lean.embed.weight.shape[1]
        self.buffers = []  # the program holds raw pointers into these
        self.x, self.h = self._buf(hidden), self._buf(hidden)
        self.scale = None if lean.embed_scale is None else lean.embed_scale.to(self.dtype)
        self.slots = torch.empty(rows, dtype=torch.long)
        d0 = lean.layers[0].head_dim
        self.rotations = {t: (self._buf(d0), self._buf(d0)) for t in lean.layer_types}
        part = iter(parts)
        self.program = step_program.Program()
        for layer in lean.layers:
            d, heads, kv = layer.head_dim, layer.heads, layer.kv_heads
            width = (heads + 2 * kv) * d
            qkv, att, o = self._buf(width), self._buf(heads * d), self._buf(hidden)
            cos, sin = self.rotations[layer.layer_type]
            k_pool, v_pool = pool.k[layer.index], pool.v[layer.index]
            self._norm(self.x, layer.norm_in, self.h)
            self._gemm(self.h, next(part), qkv)
            if layer.qk_norms is None:
                q, k = qkv[:, :heads * d], qkv[:, heads * d:(heads + kv) * d]
                self._rope(qkv, heads + kv, d, cos, sin)
            else:  # per head, each token's heads a run of rows d apart
                q, k = self._buf(heads * d), self._buf(kv * d)
                for r in range(rows):
                    for norm, source, target, n in ((layer.qk_norms[0], 0, q, heads), (layer.qk_norms[1], heads, k, kv)):
                        self._norm(qkv[r:r + 1, source * d:(source + n) * d].view(n, d), norm,
                                   target[r:r + 1].view(n, d))
                self._rope(q, heads, d, cos, sin)
                self._rope(k, kv, d, cos, sin)
            v = qkv[:, (heads + kv) * d:]
            for pool_layer, source in ((k_pool, k), (v_pool, v)):  # the pool's rows of the new tokens
                self.program.add("write_kv", None, pool_layer.data_ptr(), pool_layer.stride(0), pool_layer.stride(1),
                                 source.data_ptr(), source.stride(0), self.slots.data_ptr(), rows, kv, d,
                                 source.element_size())
            query = q.view(rows, heads, d).transpose(0, 1)
            self.program.add("attention", pa.kvql_paged_attention,
                             query.data_ptr(), query.stride(1), query.stride(0), k_pool.data_ptr(), v_pool.data_ptr(),
                             k_pool.stride(0), k_pool.stride(1), att.data_ptr(), att.stride(0), d, heads, kv, d,
                             self.is_bf16, step_program.f32(layer.scaling), int(layer.window or 0), step_program.f32(0.0))
            self._gemm(att, next(part), o)
            self._residual(o, layer.post_attention)
            self._norm(self.x, layer.norm_mlp, self.h)
            gate_up = next(part)
            n = gemv.shape(gate_up[0][0][2])[0]
            gu, act, m = self._buf(n), self._buf(n // 2), self._buf(hidden)
            self._gemm(self.h, gate_up, gu)
            self.program.add("gated_mul", self.fo.kvql_gated_mul, gu.data_ptr(), gu.stride(0), act.data_ptr(), n // 2,
                             rows, n // 2, fused_ops.ACTIVATIONS[layer.act], self.is_bf16, threads)
            self._gemm(act, next(part), m)
            self._residual(m, layer.post_mlp)
        self._norm(self.x, lean.norm, self.h)

    def _buf(self, n: int) -> torch.Tensor:
        buf = torch.empty(self.rows, n, dtype=self.dtype)
        self.buffers.append(buf)
        return buf

    def _norm(self, x: torch.Tensor, norm: _Norm, out: torch.Tensor) -> None:
        """`out = norm(x)` over the rows of `x` (`fused_ops.rms_norm`'s call)."""
        n = x.shape[1]
        self.program.add("rms_norm", self.fo.kvql_rms_norm, x.data_ptr(), x.stride(0), norm.weight.data_ptr(),
                         out.data_ptr(), out.stride(0), x.shape[0], n, step_program.f32(norm.eps), int(norm.plus_one),
                         self.is_bf16, self.threads)

    def _rope(self, x: torch.Tensor, heads: int, d: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.program.add("rope", self.fo.kvql_rope, x.data_ptr(), x.stride(0), self.rows, heads, d, cos.data_ptr(),
                         sin.data_ptr(), cos.stride(0), self.is_bf16, self.threads)

    def _residual(self, y: torch.Tensor, norm: _Norm | None) -> None:
        """x += y, or x += norm(y) (Gemma 3's post norms)."""
        if norm is not None:
            normed = self._buf(y.shape[1])
            self._norm(y, norm, normed)
            y = normed
        self._add(self.x, y)

    def _add(self, out: torch.Tensor, y: torch.Tensor) -> None:
        """out += y (rows of out's width; a 1-D y is added to every row: a bias)."""
        self.program.add("add", None, out.data_ptr(), out.stride(0), y.data_ptr(), y.stride(0) if y.dim() == 2 else 0,
                         out.shape[0], out.shape[1], self.is_bf16)

    def _gemm(self, x: torch.Tensor, part, out: torch.Tensor) -> None:
        """Steps computing `out = x @ w.T (+ bias)` as `cpu_linear._matmul` does for these rows: gemv per
        reduction slice, the slices added in order, then the bias."""
        for i, (a, _, blocked) in enumerate(part[0]):
            target = out if i == 0 else self._buf(out.shape[1])
            n, k = gemv.shape(blocked)
            self.program.add("gemv", gemv.LIBRARY.get().kvql_gemv, x.data_ptr() + a * x.element_size(), x.stride(0),
                             blocked.data_ptr(), target.data_ptr(), target.stride(0), x.shape[0], n, k, self.is_bf16,
                             self.threads)
            if i:
                self._add(out, target)
        if part[1] is not None:
            self._add(out, part[1])

    def current(self, threads: int) -> bool:
        return threads == self.threads and all(cpu_linear.unchanged(s) for s in self.sources)

    def run(self, ids, positions, write_slots, segs, keep) -> torch.Tensor:
        lean = self.lean
        torch.index_select(lean.embed.weight, 0, ids, out=self.x)
        if self.scale is not None:
            self.x.mul_(self.scale)
        for layer_type, (cos, sin) in lean.rotations(self.x, positions).items():
            self.rotations[layer_type][0].copy_(cos)
            self.rotations[layer_type][1].copy_(sin)
        self.slots.copy_(write_slots)
        self.program.run((segs.count, segs.q_start.data_ptr(), segs.q_len.data_ptr(), segs.key_start.data_ptr(),
                          segs.n_keys.data_ptr(), segs.slots.data_ptr(), segs.max_keys, self.threads))
        return lean.logits(self.h.index_select(0, keep))


def build(hf_model) -> LeanModel | None:
    """A `LeanModel` of `hf_model` (already through `fused_layers.prepare`), or None where the structure is not
    one it runs (module doc)."""
    if not (fused_ops.available() and paged_attention.available()):
        return None
    base = getattr(hf_model, "model", None)
    if base is None or any(m._forward_hooks or m._forward_pre_hooks for m in hf_model.modules()) or _global_hooks():
        return None
    structure, refs = next(((name, refs) for name, refs in _references().items()
                            if _is(hf_model, refs["causal"]) and _is(base, refs["model"])), (None, None))
    if structure is None:
        return None
    gemma = structure == "gemma3"
    embed = base.embed_tokens
    if not ((_is(embed, refs["embedding"]) if gemma else type(embed) is torch.nn.Embedding)
            and embed.max_norm is None and not getattr(base.config, "use_bidirectional_attention", False)):
        return None
    layers = list(base.layers[:base.config.num_hidden_layers])
    if not (layers and _is(base.rotary_emb, refs["rotary"]) and _swapped(base.norm, "norm")):
        return None
    for layer in layers:
        attn = layer.self_attn
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm] if gemma else []
        norms += [attn.q_norm, attn.k_norm] if _swapped(attn, "attention_qk_norm") else []
        if not (_is(layer, refs["layer"]) and _swapped(attn, "attention", "attention_qk_norm")
                and _swapped(layer.mlp, "mlp") and all(_swapped(n, "norm") for n in norms)):
            return None
    return LeanModel(hf_model, gemma)


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)
