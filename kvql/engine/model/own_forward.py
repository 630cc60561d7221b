"""The model's own forward over the pool: the exact path for any decoder-only model transformers can run
(admission's module doc, `Geometry.own`).

Each segment of a batch runs alone through the model's own forward, over a transformers cache laid out as its
config says (admission.config_cache), filled for this segment:
- a K/V layer (`kind` "kv") gets the segment's past K/V read from the pool (`past_slots`), as a plain
  `DynamicLayer` (never trimmed to a window: the model's own masks apply windows and chunks), and its new
  tokens' K/V are written back to their slots (`new_slots`) after the forward. The pool holds what the model
  caches, whatever its shape: DeepSeek's MLA latent, JetMoE's K/V before repetition.
- a recurrent layer ("state": Mamba's, Gated DeltaNet's, LFM2's convolution) gets the request's own state,
  carried between its segments in `Segment.carry` (a `RecurrentState`), or a fresh one at its first token. A
  layer with both ("kv+state") gets both. Where a prompt's chunk ends, a copy of the state goes to the
  snapshots (cache/state_snapshots.py), from which a later request with the same prefix resumes.
- a layer that caches nothing ("none") gets what the config lays out.

`stepwise`: every token runs as its own forward. Some models' own forward (Mamba's, Jamba's torch path)
computes a multi-token chunk correctly only from an empty state; the load check finds them
(model_runner.ModelRunner.verify) and turns this on, for every segment: a prompt resumed from a snapshot is
then computed as it would be from its start (in bf16 too: batched equals alone).

Batched equals alone by construction: a segment's forward never sees another segment.
"""

from __future__ import annotations

import copy

import torch

from . import admission
from ..cache.kv_pool import KVPool
from ..cache.state_snapshots import StateSnapshots
from ..segment import Segment


class RecurrentState:
    """The recurrent parts of a request's cache layers (`layers[i]`: the transformers cache layer object of a
    "state" or "kv+state" layer, holding no K/V; None for the others), after its first `length` tokens."""

    def __init__(self, layers: list):
        self.layers = layers

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers if layer is not None
                   for t in _tensors(layer))

    def clone(self) -> RecurrentState:
        return RecurrentState([None if layer is None else _clone_layer(layer) for layer in self.layers])


def _tensors(layer):
    for value in vars(layer).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        yield from (x for x in items if isinstance(x, torch.Tensor))


def _clone_layer(layer):
    """A copy of a transformers cache layer whose tensors (attributes, or values of its dicts and lists) are its
    own: the forward updates a state in place."""
    new = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            setattr(new, name, value.clone())
        elif isinstance(value, dict):
            setattr(new, name, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in value.items()})
        elif isinstance(value, list):
            setattr(new, name, [v.clone() if isinstance(v, torch.Tensor) else v for v in value])
    return new


def _drop_kv(layer) -> None:
    """Empty the K/V part of a "kv+state" layer (it is in the pool; the carried state holds none)."""
    layer.keys = layer.values = None
    layer.is_initialized = False


def forward(hf_model, cache, ids: torch.Tensor, keep: int):
    """The model's own forward of `ids` after what `cache` holds (positions follow its length)."""
    return hf_model(input_ids=ids[None], cache=cache, use_cache=True, logits_to_keep=keep)


def geometry(hf_model, reason: str) -> admission.Geometry:
    """admission.own_geometry of `hf_model`, probed through `forward`."""
    @torch.inference_mode()
    def run(cache, ids, positions):
        forward(hf_model, cache, ids.to(next(hf_model.parameters()).device), 1)

    return admission.own_geometry(hf_model, run, reason)


class OwnForward:
    def __init__(self, hf_model, pool: KVPool, geometry: admission.Geometry):
        self.model, self.pool, self.kinds = hf_model, pool, geometry.kinds
        self.device = pool.device
        self.recurrent = geometry.recurrent
        self.stepwise = False
        self.snapshots: StateSnapshots | None = None  # set by the engine for models with recurrent layers

    def __call__(self, segments: list[Segment]) -> list[torch.Tensor | None]:
        """ModelRunner.forward's contract, one segment at a time (module doc)."""
        return [self._segment(s) for s in segments]

    def _segment(self, s: Segment) -> torch.Tensor | None:
        from transformers.cache_utils import DynamicLayer

        carry = s.carry
        if carry is None and self.recurrent:
            raise RuntimeError("a segment of a model with recurrent layers without its request's state")
        if carry is not None and carry.length != s.start:
            raise RuntimeError(f"a recurrent state after {carry.length} tokens, for a segment from token {s.start}")
        carried = carry.state.layers if carry is not None and carry.state is not None else None
        cache = admission.config_cache(self.model.config)
        cache.layers += [DynamicLayer() for _ in range(len(self.kinds) - len(cache.layers))]  # (made lazily)
        past = s.past_slots.to(self.device)
        kv = []
        for i, kind in enumerate(self.kinds):
            layer = cache.layers[i]
            if "state" in kind and carried is not None:
                layer = cache.layers[i] = carried[i]
            if "kv" in kind:
                if kind == "kv":
                    layer = cache.layers[i] = DynamicLayer()
                if s.start:
                    j = len(kv)
                    DynamicLayer.update(layer, self.pool.k[j].index_select(1, past)[None],
                                        self.pool.v[j].index_select(1, past)[None])
                kv.append(layer)
        n, rows = len(s.token_ids), s.logit_rows
        end = s.start + n
        # where the forward stops for a snapshot (a mark inside the segment), or after every token (stepwise)
        cuts = sorted({m - s.start for m in (carry.marks if carry is not None and self.snapshots is not None else ())
                       if s.start < m < end})
        if self.stepwise:
            cuts = list(range(1, n))
        ids = torch.tensor(s.token_ids, device=self.device)
        parts = []
        for a, b in zip([0, *cuts], [*cuts, n]):
            keep = b - max(a, n - rows)  # the rows of the segment's last `rows` in this piece
            out = forward(self.model, cache, ids[a:b], max(keep, 1)).logits[0]
            if keep > 0:
                parts.append(out[-keep:])
            if b < n and s.start + b in (carry.marks if carry is not None and self.snapshots is not None else ()):
                self._snapshot(carry, cache, s.start + b)
        new = s.new_slots.to(self.device)
        for j, layer in enumerate(kv):
            self.pool.k[j].index_copy_(1, new, layer.keys[0, :, s.start:])
            self.pool.v[j].index_copy_(1, new, layer.values[0, :, s.start:])
        if carry is not None:
            carry.state, carry.length = self._state(cache), end
            if self.snapshots is not None and end in carry.marks:
                self.snapshots.put(carry.salt, carry.tokens[:end], carry.state.clone())
        return torch.cat(parts).float() if parts else None

    def _state(self, cache) -> RecurrentState:
        """The recurrent layers of `cache` (their K/V dropped where they hold some: the pool has it)."""
        layers = [None] * len(self.kinds)
        for i, kind in enumerate(self.kinds):
            if "state" in kind:
                layers[i] = cache.layers[i]
                if "kv" in kind:
                    _drop_kv(layers[i])
        return RecurrentState(layers)

    def _snapshot(self, carry, cache, at: int) -> None:
        """A copy of the state after the first `at` tokens, into the snapshots, mid-segment (K/V kept)."""
        layers = [None if "state" not in kind else _clone_layer(cache.layers[i]) for i, kind in enumerate(self.kinds)]
        for i, kind in enumerate(self.kinds):
            if kind == "kv+state":
                _drop_kv(layers[i])
        self.snapshots.put(carry.salt, carry.tokens[:at], RecurrentState(layers))
