"""The model's own forward over the pool: the exact path for any decoder-only model transformers can run
(admission's module doc, `Geometry.own`).

Each segment of a batch runs alone through the model's own forward, over a transformers cache laid out as its
config says (admission.config_cache), filled for this segment:
- a K/V layer (`kind` "kv") gets the segment's past K/V read from the pool (`past_slots`) through its own
  `update` (a windowed layer keeps its window, as in the model's `generate`), and the new tokens' K/V its
  `update` receives during the forward are written to their slots (`new_slots`). The pool holds what the model
  caches, whatever its shape: DeepSeek's MLA latent, JetMoE's K/V before repetition.
- a recurrent layer ("state": Mamba's, Gated DeltaNet's, LFM2's convolution) gets the request's own state,
  carried between its segments in `Segment.carry` (a `RecurrentState`), or a fresh one at its first token. A
  layer with both ("kv+state") gets both. At the request's marks (`Carry.marks`, where a later request with the
  same prefix may resume) the forward stops and a copy of the state goes to the snapshots
  (cache/state_snapshots.py).
- a layer that caches nothing ("none") gets what the config lays out.
Positions are passed where the forward takes them (`forward`).

`stepwise`: every token runs as its own forward. Some models' own forward (Mamba's, Jamba's torch path)
computes a multi-token chunk correctly only from an empty state; the load check finds them
(model_runner.ModelRunner.verify) and turns this on, for every segment: a prompt resumed from a snapshot is
then computed as it would be from its start (in bf16 too: batched equals alone).

Batched equals alone by construction: a segment's forward never sees another segment.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch

from . import admission
from ..segment import Segment


class RecurrentState:
    """The recurrent parts of a request's cache layers after some of its tokens (`Carry.length` says how many):
    `layers[i]`, the transformers cache layer object of a "state" or "kv+state" layer, holding no K/V; None for
    the others."""

    def __init__(self, layers: list):
        self.layers = layers

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers if layer is not None
                   for t in _tensors(layer))

    def clone(self) -> RecurrentState:
        return RecurrentState([None if layer is None else _clone_layer(layer) for layer in self.layers])

    def encode(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """(a JSON-able description, its tensors by name): what `decode` rebuilds the state from (the disk tier's
        snapshots file, cache/state_snapshots.py). ValueError where a layer holds a value of a kind not written."""
        tensors: dict[str, torch.Tensor] = {}
        layers = {str(i): {name: _encode(value, tensors) for name, value in vars(layer).items()}
                  for i, layer in enumerate(self.layers) if layer is not None}
        return {"layers": layers}, tensors

    @staticmethod
    def decode(config, description: dict, tensors: dict[str, torch.Tensor]) -> RecurrentState:
        """The state `encode` described, its layers of the classes the model's config lays out."""
        templates = admission.config_cache(config).layers
        layers = [None] * len(templates)
        for i, attributes in description["layers"].items():
            layer = layers[int(i)] = copy.copy(templates[int(i)])
            for name, value in attributes.items():
                setattr(layer, name, _decode(value, tensors))
        return RecurrentState(layers)


def _encode(value, tensors: dict):
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().cpu().contiguous()
        return {"tensor": name}
    if isinstance(value, dict):
        return {"dict": [[k, _encode(v, tensors)] for k, v in value.items()]}
    if isinstance(value, list):
        return {"list": [_encode(v, tensors) for v in value]}
    if isinstance(value, (torch.device, torch.dtype)):
        return {type(value).__name__: str(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise ValueError(f"a cache layer's value of type {type(value).__name__}")


def _decode(value: dict, tensors: dict):
    (kind, x), = value.items()
    if kind == "tensor":
        return tensors[x].clone()
    if kind == "dict":
        return {k: _decode(v, tensors) for k, v in x}
    if kind == "list":
        return [_decode(v, tensors) for v in x]
    if kind == "device":
        return torch.device(x)
    if kind == "dtype":
        return getattr(torch, x.removeprefix("torch."))
    return x


def _tensors(layer):
    for value in vars(layer).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        yield from (x for x in items if isinstance(x, torch.Tensor))


def _clone_layer(layer):
    """A copy of a transformers cache layer whose tensors (attributes, or values of its dicts and lists) are its
    own: the forward updates a state in place. Without a recording wrapper of a forward in progress (`_recording`)."""
    new = copy.copy(layer)
    new.__dict__ = {name: _cloned(value) for name, value in vars(layer).items() if name != "update"}
    return new


def _cloned(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) if isinstance(v, torch.Tensor) else v for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) if isinstance(v, torch.Tensor) else v for v in value]
    return value


def _recording(update, into: list):
    """`update` (a cache layer's), which also appends the K/V it is given (the new tokens') to `into`."""
    def record(key_states, value_states, *args, **kwargs):
        into.append((key_states, value_states))
        return update(key_states, value_states, *args, **kwargs)
    return record


def _drop_kv(layer) -> None:
    """Empty the K/V part of a "kv+state" layer (it is in the pool; the carried state holds none)."""
    layer.keys = layer.values = None
    layer.is_initialized = False


def forward(hf_model, cache, ids: torch.Tensor, keep: int, start: int):
    """The model's own forward of `ids` at positions `start ...`, after what `cache` holds (the tokens before
    them); the logits of the last `keep`. Positions are passed where the forward takes them (Bamba's otherwise
    start from 0 at every step)."""
    kw = {"position_ids": torch.arange(start, start + len(ids), device=ids.device)[None]} if _takes_positions(
        type(hf_model)) else {}
    return hf_model(input_ids=ids[None], cache=cache, use_cache=True, logits_to_keep=keep, **kw)


@functools.cache
def _takes_positions(model_class) -> bool:
    return "position_ids" in inspect.signature(model_class.forward).parameters


def geometry(hf_model, reason: str) -> admission.Geometry:
    """admission.own_geometry of `hf_model`, probed through `forward`."""
    @torch.inference_mode()
    def run(cache, ids):
        forward(hf_model, cache, ids.to(next(hf_model.parameters()).device), 1, 0)

    return admission.own_geometry(hf_model, run, reason)


class OwnForward:
    def __init__(self, hf_model, pool, geometry: admission.Geometry, snapshots=None):
        self.model, self.pool, self.kinds, self.snapshots = hf_model, pool, geometry.kinds, snapshots
        self.device = pool.device
        self.recurrent = geometry.recurrent
        self.stepwise = False

    def decode_state(self, description: dict, tensors: dict[str, torch.Tensor]) -> RecurrentState:
        """A snapshot read back from the disk tier (`RecurrentState.decode`)."""
        return RecurrentState.decode(self.model.config, description, tensors)

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
        kv, written = [], []  # the K/V layers, and what the forward writes to each (the new tokens' K/V)
        for i, kind in enumerate(self.kinds):
            layer = cache.layers[i]
            if "state" in kind and carried is not None:
                layer = cache.layers[i] = carried[i]
            if "kv" in kind:
                j = len(kv)
                if s.start:  # through the layer's own update: a windowed layer keeps what the model's generate would
                    layer.update(self.pool.k[j].index_select(1, past)[None], self.pool.v[j].index_select(1, past)[None])
                kv.append(layer)
                written.append([])
                layer.update = _recording(layer.update, written[-1])
        n, rows = len(s.token_ids), s.logit_rows
        end = s.start + n
        marks = carry.marks if carry is not None and self.snapshots is not None else ()
        # where the forward stops for a snapshot (a mark inside the segment), or after every token (stepwise)
        cuts = list(range(1, n)) if self.stepwise else sorted({m - s.start for m in marks if s.start < m < end})
        ids = torch.tensor(s.token_ids, device=self.device)
        parts = []
        try:
            for a, b in zip([0, *cuts], [*cuts, n]):
                keep = b - max(a, n - rows)  # the rows of the segment's last `rows` in this piece
                out = forward(self.model, cache, ids[a:b], max(keep, 1), s.start + a).logits[0]
                if keep > 0:
                    parts.append(out[-keep:])
                if b < n and s.start + b in marks:
                    self._snapshot(carry, cache, s.start + b)
        finally:
            for layer in kv:
                del layer.update
        new = s.new_slots.to(self.device)
        for j, pieces in enumerate(written):  # [1, heads, tokens, dim] each; the last len(new) are the segment's
            self.pool.write(j, new, torch.cat([k for k, _ in pieces], dim=-2)[0, :, -len(new):],
                            torch.cat([v for _, v in pieces], dim=-2)[0, :, -len(new):])
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
