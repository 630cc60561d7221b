"""A mixture-of-experts layer's experts on quantized weights (qgemm), for `quantized.apply`.

transformers holds a layer's experts as 3-D weights in one module (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`:
the classes `use_experts_implementation` decorates). `QuantizedExperts` takes such a module's place: each expert's
two weights a `qgemm.QWeight`, stacked over the experts into one buffer each (held once), run by the loop
transformers' eager experts forward runs: each expert's tokens gathered, gate/up, the module's own gating
(`_apply_gate`: the activation and the gate/up layout), down, times the routing weight, added in expert order. A
token's result depends on its own row and experts only (qgemm's chain per row), so batched == alone holds as for any
quantized layer, and the quantized model's own forward is this one.

Taken: experts with a gate, their weights not transposed, no biases, no norm after each expert (Qwen2-MoE, Qwen3-MoE,
Mixtral, OLMoE, DeepSeek-V2/V3, ...); other experts modules stay as they are (`takes` says why not).
"""

from __future__ import annotations

import torch

from .kernels import qgemm


def takes(module: torch.nn.Module) -> str | None:
    """None where `module` is an experts module `QuantizedExperts` replaces, else why not (or "" for no experts
    module at all)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and hasattr(module, "has_gate")):
        return ""
    if not module.has_gate or module.has_bias or module.is_transposed or module.has_post_expert_norm:
        return "experts with biases, no gate, transposed weights or a norm per expert"
    e, two_i, h = gate_up.shape
    if down.shape != (e, h, two_i // 2) or not (qgemm.fits(two_i, h) and qgemm.fits(h, two_i // 2)):
        return "shape"
    return None


def _stacked(weights: list[qgemm.QWeight]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The experts' weights (same shape and bits) as one tensor each, the scales in one dtype."""
    dtype = torch.float32 if any(w.scale.dtype == torch.float32 for w in weights) else torch.float16
    mins = None if weights[0].min is None else torch.stack([w.min.to(dtype) for w in weights])
    return torch.stack([w.q for w in weights]), torch.stack([w.scale.to(dtype) for w in weights]), mins


class QuantizedExperts(torch.nn.Module):
    """The experts of `module` (`takes(module)` is None) on `gate_up` and `down`, one `QWeight` per expert (module
    doc); `kind` names their format. `module` is kept (its 3-D weights dropped) for its gating and flags."""

    def __init__(self, module: torch.nn.Module, gate_up: list[qgemm.QWeight], down: list[qgemm.QWeight], kind: str):
        super().__init__()
        if len({(w.bits, w.group) for w in gate_up}) > 1 or len({(w.bits, w.group) for w in down}) > 1:
            raise ValueError("qgemm: experts differ in bits or groups")
        self.num_experts, self.kind = len(gate_up), kind
        self.shapes = [(w.n, w.k, w.bits, w.group) for w in (gate_up[0], down[0])]
        for name, weights in (("gate_up", gate_up), ("down", down)):
            q, scale, mins = _stacked(weights)
            self.register_buffer(f"{name}_q", q)
            self.register_buffer(f"{name}_scale", scale)
            self.register_buffer(f"{name}_min", mins)
        del module.gate_up_proj, module.down_proj
        self.experts = module

    def weight(self, which: int, e: int) -> qgemm.QWeight:
        """Expert `e`'s gate/up (`which` 0) or down (1) weight."""
        name = ("gate_up", "down")[which]
        mins = getattr(self, f"{name}_min")
        n, k, bits, group = self.shapes[which]
        return qgemm.QWeight(getattr(self, f"{name}_q")[e], getattr(self, f"{name}_scale")[e],
                             None if mins is None else mins[e], n, k, bits, group)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        from .quantized import linear

        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == self.num_experts:
                continue
            position, token = torch.where(mask[e])
            gated = self.experts._apply_gate(linear(hidden_states[token], [self.weight(0, e)], None))
            y = linear(gated, [self.weight(1, e)], None) * top_k_weights[token, position, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out
