"""Lean forward: a model's forward over the KV pool as its step description (`step`), run layer by layer without
transformers' module calls, or compiled into one C step program for a few rows; the same kernels on the same
tensors as the swapped modules' forward (which runs the same steps), so its logits equal the model's own
forward's bit for bit.

Why: a decode step of one stream is a few hundred small calls around its GEMMs; through transformers each layer
adds module calls, decorators, keyword plumbing, the attention interface lookup and kvql's cache object, which
cost a batch-1 step nearly as much as its GEMMs (docs/benchmarks.md, forward_overhead). The model runner calls
`LeanModel.forward` instead of the model wherever it applies (`build`), and the model's own forward elsewhere.

Where it applies, by structure (`build` returns None otherwise), two of them:
- Llama's: the causal LM's and base model's forwards the same functions (`fused_layers.same_function`) as
  Llama's, Qwen2's, Mistral's or Qwen3's, every decoder layer's Llama's, the rotary embedding's Llama's;
- Gemma 3's: the causal LM's, base model's, decoder layers', rotary embedding's and scaled embedding's forwards
  Gemma 3's (text), attention causal (not `use_bidirectional_attention`);
and in both every attention, MLP and RMSNorm of the layers and the final norm one that `fused_layers.prepare`
swapped, and no module with a hook. The description (`_describe_layer`): the embedding (Gemma 3: times its
scale) and cos/sin from the rotary module (Gemma 3: per layer type) outside the layers; per layer the steps
in the order transformers computes them; the final norm; `lm_head` over the rows asked for (Gemma 3: the final
logit soft-cap where the config has one).

Contract: `forward(ids [T], positions [T], write_slots [T], plan, rows)` on a CPU in float32 or bfloat16 with a
paged plan (`Plan.paged`), under inference mode: float32 logits `[len(rows), vocab]`, the pool written exactly as
the model's own forward writes it. `usable(dtype)` says whether a call in that dtype may take it (the swapped
modules' own condition: weights of that dtype). The model's parts are read once, when it is described: weights
edited in place are followed (the bound programs are built again when a GEMM's weight or bias changes:
`cpu_linear.unchanged`, checked each step), other parameters replaced by other tensors are not (an engine's
model is not converted or reloaded while it runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_linear, fused_layers, quantized, step
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


@dataclass(frozen=True)
class Layer:
    """One decoder layer as steps (`step`), in the order transformers computes it, reading and updating the
    residual stream `x`; `layer_type` selects its rotation (Gemma 3's rotary embedding per layer type; None:
    one for all layers)."""
    steps: list
    layer_type: str | None


def _describe_layer(layer, gemma: bool) -> Layer:
    """The input norm, the attention's projection (`fused_layers.attention_steps`), K/V written to the pool,
    paged attention, `o_proj` (Gemma 3: its post-attention norm), the residual sum; the MLP's norm, the MLP
    (`fused_layers.mlp_steps`; Gemma 3: its post-feedforward norm), the residual sum."""
    attn, norm = layer.self_attn, fused_layers.norm_step
    a = fused_layers.attention_steps(attn, "h")
    window = fused_layers.kind(attn.kvql_original)[1](attn).get("sliding_window")
    index, hidden = attn.layer_idx, attn.o_proj.out_features
    steps = [norm(layer.input_layernorm, "x", "h"), *a.project,
             step.WriteKV(a.k, a.v, index, a.kv_heads, a.head_dim),
             step.Attend(a.q, "att", index, a.heads, a.kv_heads, a.head_dim, attn.scaling or a.head_dim ** -0.5,
                         window),
             step.Gemm("att", "o", hidden, attn.o_proj, direct=True)]  # no hooks: `build`
    if gemma:
        steps += [norm(layer.post_attention_layernorm, "o", "o_norm"), step.Add("x", "o_norm"),
                  norm(layer.pre_feedforward_layernorm, "x", "h"),
                  *fused_layers.mlp_steps(layer.mlp, "h", "m", direct=True),
                  norm(layer.post_feedforward_layernorm, "m", "m_norm"), step.Add("x", "m_norm")]
    else:
        steps += [step.Add("x", "o"), norm(layer.post_attention_layernorm, "x", "h"),
                  *fused_layers.mlp_steps(layer.mlp, "h", "m", direct=True), step.Add("x", "m")]
    return Layer(steps, getattr(attn, "layer_type", None) if gemma else None)


_UNBUILT = object()


class LeanModel:
    def __init__(self, hf_model, gemma: bool):
        base = hf_model.model
        dtypes = {p.dtype for p in hf_model.parameters()}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else None  # an engine's model is not converted while it runs
        self.embed, self.rotary = base.embed_tokens, base.rotary_emb
        self.embed_scale = base.embed_tokens.embed_scale if gemma else None
        self.softcap = getattr(hf_model.config, "final_logit_softcapping", None) if gemma else None
        self.lm_head = hf_model.lm_head
        self.layers = [_describe_layer(layer, gemma) for layer in base.layers[:base.config.num_hidden_layers]]
        self.final = fused_layers.norm_step(base.norm, "x", "h")
        self.head_dim = base.layers[0].self_attn.head_dim
        self.layer_types = sorted({layer.layer_type for layer in self.layers}, key=str)
        self._programs: dict[int, _Program | None] = {}

    def usable(self, dtype: torch.dtype) -> bool:
        """Whether a forward in `dtype` may take this path: every weight of the model was of that dtype when it
        was built."""
        return dtype == self.dtype and dtype in fused_ops.DTYPES

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        x = quantized.embedding_rows(self.embed, ids)
        if x is None:
            x = torch.nn.functional.embedding(ids, self.embed.weight)
        return x if self.embed_scale is None else x * self.embed_scale.to(x.dtype)

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
            env = step.Env(pool, write_slots, plan.paged)  # a layer's intermediates go with it
            env["x"] = x
            env.cos, env.sin = rotations[layer.layer_type]
            x = step.run(layer.steps, env)["x"]
        return self.logits(self.final.apply(x).index_select(0, rows))


class _Program:
    """A decode step of `rows` (<= `cpu_linear.gemv_rows`) tokens compiled from the lean model's steps: each step
    adds the C calls of the kernels its `run` calls (`compile(p)`, beside its `run` in step.py), with their
    arguments bound once (every GEMM through gemv's blocked copies, as `cpu_linear._matmul` runs a few rows, or a
    quantized layer's qgemm), intermediate rows in this program's buffers (`out`: one per name and width, reused
    by every layer; `bound`: the buffer a name was last written to; `cols`), the list run by one C call
    (`kernels/step_program.py`) instead of ~40 Python calls and allocations per layer. The same operations in the
    same order as the steps' `run`: the same results bit for bit. `current(threads)` is False once a weight
    changed or the thread count did (the program is built again)."""

    @classmethod
    def build(cls, lean: LeanModel, rows: int, pool, threads: int) -> _Program | None:
        gemms = {id(s): step.gemm_parts(s.linear) for layer in lean.layers for s in layer.steps
                 if isinstance(s, step.Gemm)}
        plain = any(isinstance(g, step.GemmParts) for g in gemms.values())
        if (any(g is None for g in gemms.values()) or (plain and rows > gemv.max_rows())
                or not step_program.available()):
            return None
        return cls(lean, rows, pool, threads, gemms)

    def __init__(self, lean: LeanModel, rows: int, pool, threads: int, gemms: dict):
        self.lean, self.rows, self.threads, self.pool, self.gemms = lean, rows, threads, pool, gemms
        self.sources = [g.packs.source if isinstance(g, step.GemmParts) else g.source for g in gemms.values()]
        self.dtype, self.is_bf16 = lean.dtype, fused_ops.DTYPES[lean.dtype]
        self.fo, self.pa = fused_ops.LIBRARY.get(), paged_attention.LIBRARY.get()
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}  # the program holds raw pointers into these
        self.bound: dict[str, torch.Tensor] = {}  # name -> the buffer a step last wrote under it
        self.x = self.out("x", lean.embed.embedding_dim)
        self.scale = None if lean.embed_scale is None else lean.embed_scale.to(self.dtype)
        self.slots = torch.empty(rows, dtype=torch.long)
        d = lean.head_dim
        self.rotations = {t: (self.out(f"cos.{t}", d), self.out(f"sin.{t}", d)) for t in lean.layer_types}
        self.program = step_program.Program()
        for layer in lean.layers:
            self.cos, self.sin = self.rotations[layer.layer_type]
            for s in layer.steps:
                s.compile(self)
        lean.final.compile(self)
        self.h = self.bound["h"]

    def out(self, name: str, width: int) -> torch.Tensor:
        """The buffer a step writes `name` into (one per name and width), bound to `name` from now on."""
        buf = self.buffers.get((name, width))
        if buf is None:
            buf = self.buffers[name, width] = torch.empty(self.rows, width, dtype=self.dtype)
        self.bound[name] = buf
        return buf

    def cols(self, c: step.Cols) -> torch.Tensor:
        return self.bound[c.buf][:, c.start:c.start + c.width]

    def current(self, threads: int) -> bool:
        return threads == self.threads and all(cpu_linear.unchanged(s) for s in self.sources)

    def run(self, ids, positions, write_slots, segs, keep) -> torch.Tensor:
        lean = self.lean
        rows = quantized.embedding_rows(lean.embed, ids)  # an embedding tied to a quantized head
        if rows is None:
            torch.index_select(lean.embed.weight, 0, ids, out=self.x)
        else:
            self.x.copy_(rows)
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
    cls = embed.replaced if isinstance(embed, quantized.TiedEmbedding) else type(embed)  # (a quantized head's)
    if not ((any(fused_layers.same_function(cls.forward, r.forward) for r in refs["embedding"]) if gemma
             else cls is torch.nn.Embedding)
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
