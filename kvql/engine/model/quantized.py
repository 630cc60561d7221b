"""A model's linear layers on quantized weights (`kernels/qgemm.py`): `apply(model, weights, gguf=FILE)`.

`weights`:
- `"gguf"`: each linear layer takes the GGUF file's own blocks (`gguf`: a `gguf_blocks.File`, the file mapped) where
  qgemm runs their type (`gguf_blocks.TYPES`: Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, Q5_K, Q4_K, Q6_K, Q3_K, Q2_K, IQ4_NL,
  IQ4_XS): the weights a CPU user runs with llama.cpp, bit for bit. A layer is matched to its tensor by
  transformers' own GGUF name map, its rows put in the model's order by transformers' own tensor processor (Llama's
  q/k permutation), and, where the model loaded a float weight, taken only if the blocks, dequantized, equal it (in
  its dtype); a layer built from the file directly (its weight on the meta device: `kvql.backends.gguf_model`)
  takes them as they are. A layer the file holds in another type, or cannot be matched, stays dequantized, and the
  report says so.
- `"int8"` / `"int4"`: any model's linear weights quantized per group of 32 inputs: int8 symmetric (scale = max |w|
  / 127), int4 with a minimum (scale = (max - min) / 15), scales rounded to float16 first (as GGUF's Q8_0 / Q4_1);
  with int4 the LM head takes int8 (llama.cpp's 4-bit mixes keep their output layer at 6-8 bits: the head's
  rounding moves every logit).

Which layers: every `nn.Linear` of the model (the decoder's projections and the LM head) whose shape qgemm takes
(`qgemm.fits`), and a mixture-of-experts layer's 3-D experts (`quantized_experts.py`: from the file's
`ffn_*_exps` blocks with "gguf"); others stay as they are. An embedding tied to a quantized head looks its rows up
in the head (`TiedEmbedding`: the GGUF file's token embedding is that tensor; llama.cpp looks rows up in it too),
its float copy dropped. A layer becomes a `QuantizedLinear` (its float weight dropped: memory is the quantized
bytes), which the engine's forwards run as any linear layer: the swapped modules and the lean forward stack q/k/v
and gate/up into one quantized GEMM (`QuantizedStack`), and the lean forward's C step program calls qgemm
directly. Every output is batch-invariant (qgemm's chain per output), so cached == uncached and batched == alone
hold for a quantized model as for any, its reference being its own forward. The quantized tensors are the module's
buffers: they are in the state dict, so the disk tier's fingerprint tells a quantized model from its dequantized
twin.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from . import gguf_blocks, quantized_experts
from .gguf_weights import gguf_names, gguf_processor
from .kernels import qgemm

WEIGHTS = ("gguf", "int8", "int4")
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Layers the engine stacks into one GEMM (`fused_layers.stacked`): quantized together or not at all."""


class QuantizedLinear(torch.nn.Module):
    """`y = x @ w.T + bias` with w a `qgemm.QWeight` (module doc); `kind` names its format ("Q4_1", "int8", ...)."""

    def __init__(self, weight: qgemm.QWeight, bias: torch.Tensor | None, kind: str):
        super().__init__()
        self.in_features, self.out_features, self.kind = weight.k, weight.n, kind
        self.bits, self.group = weight.bits, weight.group
        self.register_buffer("qweight", weight.q)
        self.register_buffer("qscale", weight.scale)
        self.register_buffer("qmin", weight.min)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def packed(self) -> qgemm.QWeight:
        return qgemm.QWeight(self.qweight, self.qscale, self.qmin, self.out_features, self.in_features, self.bits,
                             self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, [self.packed], self.bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized (`QWeight.dequantized`), in `dtype` (`[*ids.shape, k]`): what a tied
        embedding looks up."""
        return self.packed.dequantized(ids.reshape(-1)).to(dtype).view(*ids.shape, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


def linear(x: torch.Tensor, weights: list[qgemm.QWeight], bias: torch.Tensor | None) -> torch.Tensor:
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    rows = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
    outs = [qgemm.qgemm(rows, w) for w in weights]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
    out = out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)
    return out if bias is None else out + bias.to(out.dtype)


class QuantizedStack:
    """Quantized layers reading the same input (q/k/v, gate/up) as one GEMM: their weights stacked along the outputs
    where they share bits, groups and scale dtype (`weights` then has one entry, and the parts' buffers are views of
    it: memory held once), else one GEMM each, concatenated. Equal to `cat([part(x) ...], -1)` bit for bit: each
    output is its own chain (qgemm). Not a module (as `cpu_linear.Stacked`)."""

    def __init__(self, parts: list[QuantizedLinear]):
        self.parts = list(parts)
        self.in_features = parts[0].in_features
        packed = [p.packed for p in parts]
        same = all((w.bits, w.group, w.scale.dtype) == (packed[0].bits, packed[0].group, packed[0].scale.dtype)
                   for w in packed)
        self.weights = [qgemm.QWeight.cat(packed)] if same else packed
        if same:  # the parts' buffers become views of the stacked weight: held once
            start = 0
            for p in parts:
                blocks = slice(start, start + p.out_features // 16)
                p.qweight, p.qscale = self.weights[0].q[blocks], self.weights[0].scale[blocks]
                if p.qmin is not None:
                    p.qmin = self.weights[0].min[blocks]
                start = blocks.stop
        biases = [p.bias for p in parts]
        given = next((b for b in biases if b is not None), None)
        self.bias = None if given is None else torch.cat(
            [b.detach() if b is not None else given.new_zeros(p.out_features) for b, p in zip(biases, parts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weights, self.bias)

    __call__ = forward


class TiedEmbedding(torch.nn.Embedding):
    """kvql's replacement for an embedding whose weight was the LM head's (tied): it looks its rows up in the
    quantized head (`QuantizedLinear.rows`, in the dtype the embedding had), with no float copy of its own. Made by
    `_tie` from a plain lookup (`replaced`: `nn.Embedding`, or Gemma 3's scaled one, whose `embed_scale` it applies
    as that forward does). `head` is held, not registered: its buffers are in the state dict once, under the head's
    own name."""

    def __init__(self, embed: torch.nn.Embedding, head: QuantizedLinear):
        torch.nn.Module.__init__(self)
        for name in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                     "sparse"):
            setattr(self, name, getattr(embed, name))
        self.register_parameter("weight", None)
        scale = embed._buffers.get("embed_scale")
        if scale is not None:
            kept = "embed_scale" not in embed._non_persistent_buffers_set
            self.register_buffer("embed_scale", scale, persistent=kept)
        self.replaced, self.rows_dtype = type(embed), embed.weight.dtype
        object.__setattr__(self, "head", head)  # (module doc: not a submodule)

    def forward(self, input_ids):
        x = self.head.rows(input_ids, self.rows_dtype)
        scale = getattr(self, "embed_scale", None)
        return x if scale is None else x * scale.to(x.dtype)


def embedding_rows(embed: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor | None:
    """The rows of a `TiedEmbedding` (before any scale), or None for another embedding (its weight has them)."""
    return embed.head.rows(ids, embed.rows_dtype) if isinstance(embed, TiedEmbedding) else None


def _tie(model: torch.nn.Module, embed: torch.nn.Module, head: QuantizedLinear) -> bool:
    """Put a `TiedEmbedding` of `head` in `embed`'s place where its forward is a plain lookup (nn.Embedding's, or
    Gemma 3's scaled one) with no options that change rows; returns whether it did."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    if type(embed).forward not in (torch.nn.Embedding.forward, Gemma3TextScaledWordEmbedding.forward) or embed.max_norm:
        return False
    model.set_input_embeddings(TiedEmbedding(embed, head))
    return True


def quantizable(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) and qgemm.fits(module.out_features, module.in_features)


def _group_quantize(w: torch.Tensor, bits: int) -> qgemm.QWeight:
    """Float weight `w` [n, k] quantized per group of 32 (module doc)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // 32, 32)
    if bits == 8:
        scale = (g.abs().amax(-1) / 127).half().float()
        q = torch.where(scale[..., None] > 0, g / scale[..., None], 0).round().clamp(-128, 127)
        return qgemm.QWeight.pack(q.reshape(n, k).to(torch.int32), scale)
    lo, hi = g.amin(-1).half().float(), g.amax(-1)
    scale = ((hi - lo) / 15).half().float()
    q = torch.where(scale[..., None] > 0, (g - lo[..., None]) / scale[..., None], 0).round().clamp(0, 15)
    return qgemm.QWeight.pack(q.reshape(n, k).to(torch.int32), scale, lo)


@dataclass
class Report:
    """What `apply` did: layers per format, their bytes, and the layers left dequantized with why."""
    weights: str
    kinds: collections.Counter = field(default_factory=collections.Counter)
    quantized_bytes: int = 0
    float_bytes: int = 0
    left: dict[str, list[str]] = field(default_factory=dict)
    tied: bool = False

    def line(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items()))
        tied = " (the embedding looks up the head's rows)" if self.tied else ""
        text = (f"weights {self.weights}: {sum(self.kinds.values())} linear layers quantized ({kinds}), "
                f"{self.quantized_bytes / 2**20:.0f} MiB{tied}; other parameters {self.float_bytes / 2**20:.0f} MiB")
        text += f"; kernel {qgemm.kernel()}"
        if not qgemm.fast():
            text += (" (this CPU has neither AVX512-VNNI nor AVX2 + FMA + F16C: about 30x slower than either; "
                     "bf16 or float32 weights run faster here)")
        for why, names in sorted(self.left.items()):
            text += f"; {len(names)} left dequantized ({why}: {names[0]}{', ...' if len(names) > 1 else ''})"
        return text


def apply(model: torch.nn.Module, weights: str, gguf: gguf_blocks.File | None = None) -> Report:
    """Replace the linear layers of `model` (on the CPU) by `QuantizedLinear` (module doc). Raises ValueError for an
    unknown `weights`, `"gguf"` without a file, or a model not on the CPU. A layer whose weight is on the meta
    device (built from the file directly, `kvql.backends.gguf_model`) takes the file's blocks unchecked."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS} (or None: dequantized), got {weights!r}")
    if any(p.device.type not in ("cpu", "meta") for p in model.parameters()):
        raise ValueError("quantized weights run on the CPU (qgemm); load the model with device='cpu'")
    if not qgemm.available():
        raise ValueError(f"quantized weights need kvql's qgemm kernel, which cannot be built here "
                         f"({qgemm.LIBRARY.error or 'KVQL_QGEMM=0'})")
    if weights == "gguf" and gguf is None:
        raise ValueError("weights='gguf' needs the model's GGUF file")
    report = Report(weights)
    blocks = _GGUF(model, gguf) if weights == "gguf" else None
    names = {id(m): n for n, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = embed is not None and head is not None and head.weight is embed.weight
    # (parent, child name) -> (its name, (qgemm.QWeight, kind) or why the layer stays dequantized); each layer packed
    # at once: the int32 values of every layer together would take 4 bytes per weight
    found = {}
    for parent in list(model.modules()):
        for child_name, child in parent.named_children():
            if isinstance(child, torch.nn.Linear):
                name = f"{names[id(parent)]}.{child_name}".lstrip(".")
                if not quantizable(child):
                    got = "shape"
                elif blocks is not None:
                    got = blocks.layer(name, child)
                elif weights == "int4" and child is head:  # the head in 8 bits, as llama.cpp's Q4 mixes keep it
                    got = _group_quantize(child.weight, 8), "int8"
                else:
                    got = _group_quantize(child.weight, 8 if weights == "int8" else 4), weights
                found[parent, child_name] = name, got
            elif (why := quantized_experts.takes(child)) is None:
                _experts(report, parent, child_name, child, blocks, weights, names)
            elif why:  # experts kept as they are
                report.left.setdefault(why, []).append(f"{names[id(parent)]}.{child_name}")
    for (parent, child_name), (name, got) in found.items():
        group = next((g for g in SIBLINGS if child_name in g), ())
        if not isinstance(got, str) and any(isinstance(found[parent, n][1], str) for n in group if (parent, n) in found):
            got = "a layer stacked with it is left dequantized"
        if isinstance(got, str):
            report.left.setdefault(got, []).append(name)
            continue
        layer = QuantizedLinear(got[0], getattr(parent, child_name).bias, got[1])
        setattr(parent, child_name, layer)
        report.kinds[got[1]] += 1
        report.quantized_bytes += layer.packed.nbytes()
    head = model.get_output_embeddings()
    report.tied = tied and isinstance(head, QuantizedLinear) and _tie(model, embed, head)
    report.float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return report


def _experts(report: Report, parent, child_name: str, module, blocks, weights: str, names: dict) -> None:
    """Replace the experts `module` by `QuantizedExperts` (quantized_experts.py), or say why it stays."""
    name = f"{names[id(parent)]}.{child_name}".lstrip(".")
    if blocks is not None:
        got = blocks.experts(name, module)
    else:
        bits = 8 if weights == "int8" else 4
        got = ([_group_quantize(w, bits) for w in module.gate_up_proj],
               [_group_quantize(w, bits) for w in module.down_proj], weights)
    if isinstance(got, str):
        report.left.setdefault(got, []).append(name)
        return
    experts = quantized_experts.QuantizedExperts(module, *got)
    setattr(parent, child_name, experts)
    report.kinds[f"{got[2]} experts"] += 1
    report.quantized_bytes += experts.nbytes()


class _GGUF:
    """A GGUF file's tensors for `model`'s linear layers (module doc: matched by transformers' name map, rows
    ordered by its tensor processor, checked against the loaded weight where one was loaded: a layer built from the
    file directly holds none)."""

    def __init__(self, model: torch.nn.Module, file: gguf_blocks.File):
        self.tensors = file.tensors
        self.processor = gguf_processor(file.architecture, model.config)
        self.hf_to_gguf = {hf: g for g, hf in gguf_names(model, self.processor).items()}
        embed = model.get_input_embeddings()
        head = model.get_output_embeddings()
        if head is not None and embed is not None and head.weight is embed.weight and "output.weight" not in self.tensors:
            # a tied head is the file's token embedding (else it stays unmatched: the report says so)
            embed_name = next((n for n, p in model.named_parameters(remove_duplicate=False) if p is embed.weight
                               and n in self.hf_to_gguf), None)
            head_name = next(n for n, m in model.named_modules() if m is head)
            if embed_name is not None:
                self.hf_to_gguf[f"{head_name}.weight"] = self.hf_to_gguf[embed_name]

    def layer(self, name: str, linear: torch.nn.Linear):
        """`(qgemm.QWeight, type name)` for the layer `name`, or why it stays dequantized."""
        import numpy as np

        tensor = self.tensors.get(self.hf_to_gguf.get(f"{name}.weight", ""))
        if tensor is None:
            return "not matched to a tensor of the file"
        kind = tensor.type_name
        n, k = linear.out_features, linear.in_features
        fits = tensor.dims[:2] == (k, n) and len(tensor.dims) == 2
        decoded = gguf_blocks.decode(kind, tensor.raw.reshape(n, -1), k) if fits else None
        if decoded is None:
            return f"{kind}: a type qgemm does not run"
        order = torch.from_numpy(np.ascontiguousarray(
            self.processor.process(np.arange(n).reshape(n, 1), tensor.name).weights.reshape(n))).long()
        packed = qgemm.QWeight.pack(*(None if t is None else t.index_select(0, order) for t in decoded),
                                    bits=gguf_blocks.BITS[kind])
        loaded = linear.weight.detach()
        if not loaded.is_meta and not torch.equal(packed.dequantized().to(loaded.dtype), loaded):
            return f"{kind}: blocks differ from the loaded weight"
        return packed, kind

    def experts(self, name: str, module: torch.nn.Module):
        """`(gate/up weights, down weights, type name)` per expert for the experts module `name` from the file's
        3-D tensors `blk.N.ffn_{gate,up,down}_exps` (gate then up: transformers' `gate_up_proj`), or why not."""
        import re

        layer = re.search(r"layers\.(\d+)\.", name)
        parts = [self.tensors.get(f"blk.{layer[1]}.ffn_{w}_exps.weight") if layer else None
                 for w in ("gate", "up", "down")]
        if any(t is None for t in parts):
            return "experts not matched to tensors of the file"
        e, two_i, h = module.gate_up_proj.shape
        if parts[0].type_name != parts[1].type_name:
            return f"experts' gate and up in different types ({parts[0].type_name}, {parts[1].type_name})"
        shapes = [(h, two_i // 2, e), (h, two_i // 2, e), (two_i // 2, h, e)]
        if [t.dims for t in parts] != shapes or not all(t.type_name in gguf_blocks.TYPES for t in parts):
            return f"experts: {parts[0].type_name}/{parts[2].type_name}: a type or shape qgemm does not run"

        def expert(t, i, rows, k):
            return gguf_blocks.decode(t.type_name, t.raw[i * rows:(i + 1) * rows], k)

        gate_up, down = [], []
        for i in range(e):
            g, u = expert(parts[0], i, two_i // 2, h), expert(parts[1], i, two_i // 2, h)
            decoded = [None if a is None else torch.cat([a, b]) for a, b in zip(g, u)]
            gate_up.append(qgemm.QWeight.pack(*decoded, bits=gguf_blocks.BITS[parts[0].type_name]))
            down.append(qgemm.QWeight.pack(*expert(parts[2], i, h, two_i // 2),
                                           bits=gguf_blocks.BITS[parts[2].type_name]))
        for weights, loaded in ((gate_up, module.gate_up_proj), (down, module.down_proj)):
            if not loaded.is_meta and any(not torch.equal(w.dequantized().to(loaded.dtype), loaded[i].detach())
                                          for i, w in enumerate(weights)):
                return f"experts: {parts[0].type_name}: blocks differ from the loaded weights"
        return gate_up, down, "/".join(dict.fromkeys(t.type_name for t in parts))
