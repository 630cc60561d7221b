"""Recurrent layers on the ragged path: one forward per engine step for a hybrid model's whole batch.

A hybrid model (Qwen3.5 / Qwen3-Next's Gated DeltaNet, LFM2's short convolutions, the Mamba layers of Granite 4,
Nemotron-H, Falcon-H1, Zamba2, Bamba, Jamba, Mamba) runs on the ragged path like any attention model: its
attention layers write and read the pool through the engine's cache and attention function, its MLPs and
norms run once over the batch's tokens. Only each recurrent layer's *mixer* (the module that reads and updates
the layer's state; `find`) is computed per request, by the model's own mixer code: `prepare` swaps each mixer's
class for a subclass whose forward, given the engine's `PoolCache`, splits the flat row of new tokens as the
`Step` says and calls the mixer's own forward with a transformers cache holding the state of the rows it gets:

- *stepped*: the segments that continue a state by a few tokens (decode steps, a question after a few-shot
  prefix resumed from a snapshot, forced tokens), token by token, the t-th tokens of all of them in one call,
  their states stacked along the batch axis (the model's own batched decode, as its `generate` runs a batch);
- every other segment alone (a prompt or a long chunk of it, a segment after a fresh state), split at its marks
  (where a snapshot of its state is taken, `Carry.marks`) and, `stepwise`, into single tokens (a model whose own
  forward continues a state by a chunk otherwise than its `generate`: model_runner.ModelRunner._continuation).

After the forward, `Step.finish` hands each request its state (`Carry.state`: views of its rows of the stacked
states) and puts the snapshots. Requests never see each other: a call's rows are its own; stacking equal-shape
states along the batch axis changes no row's arithmetic (the update is elementwise and per-row products). A
stepped continuation runs the model's one-token update, as its `generate` decodes, where a chunk would run its
chunked form: the load check compares both with the model's own steps (model_runner.ModelRunner.verify). A
mixer's output has the shape of its input (an out-projection back to the hidden size).

Mixers of a form kvql computes itself (Qwen3.5's Gated DeltaNet, LFM2's short convolution: mixer_steps.py) take every
segment of the forward in one call instead, each from its request's state in place (`Mixers.own_step`). A drafted
segment (speculative decoding) keeps its state after each drafted token (`Carry.drafted`), for the scheduler to go
back to the one after the last accepted.

Any other call of a swapped mixer (transformers' own `generate`, the reference forwards) runs the mixer's own
forward unchanged; a probe's (admission.probe) runs it on a fresh transformers cache (`Fresh`).
"""

from __future__ import annotations

import copy
import inspect

import torch

from . import admission, class_swap, mixer_steps, ragged_scan
from .own_forward import RecurrentState, _clone_layer
from ..segment import Segment

STEP_MAX = 16  # a continuation of at most this many tokens from a state is stepped with the others (`Step`)


def find(hf_model, kinds: tuple[str, ...]) -> dict[int, torch.nn.Module] | None:
    """Layer index -> the mixer of each recurrent layer (`kinds`: admission.layer_kind per layer): the innermost
    module whose forward takes `hidden_states` and a `cache`, and no positions, with that `layer_idx`; None where
    some recurrent layer has not exactly one."""
    wanted = {i for i, kind in enumerate(kinds) if "state" in kind}
    found: dict[int, list] = {i: [] for i in wanted}
    for module in hf_model.modules():
        i = getattr(module, "layer_idx", None)
        if i in wanted and _takes_cache(type(module)):
            found[i].append(module)
    mixers = {}
    for i, modules in found.items():
        inner = [m for m in modules if not any(o is not m and o in set(m.modules()) for o in modules)]
        if len(inner) != 1:
            return None
        mixers[i] = inner[0]
    return mixers


def _takes_cache(cls) -> bool:
    try:
        params = inspect.signature(getattr(cls, "kvql_mixer_of", cls).forward).parameters
    except (TypeError, ValueError):
        return False
    return "hidden_states" in params and "cache" in params and not {"position_ids", "position_embeddings"} & set(params)


def prepare(mixers: dict[int, torch.nn.Module]) -> None:
    """Swap each mixer's class for its ragged subclass (module doc); idempotent."""
    for module in mixers.values():
        class_swap.swap(module, "kvql_mixer_of", "Ragged", {"forward": _forward})


def restore(mixers: dict[int, torch.nn.Module]) -> None:
    class_swap.restore(mixers.values(), "kvql_mixer_of")


def _forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    original = type(self).kvql_mixer_of.forward
    step = getattr(cache, "recurrent", None)  # the engine's cache (`Step`) or a probe's (`Fresh`)
    if step is not None:
        return step.mix(self, original, hidden_states, kwargs)
    return original(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)


class Fresh:
    """A probe's recurrent work: its one sequence from a fresh state (a transformers cache of the model's)."""

    def __init__(self, config):
        self.cache = admission.config_cache(config)

    def mix(self, module, original, hidden_states: torch.Tensor, kwargs: dict) -> torch.Tensor:
        kwargs.pop("kvql_plan", None)
        return original(module, hidden_states, cache=self.cache, attention_mask=None, **kwargs)


class Alone:
    """One segment computed alone by each mixer: at flat `offset`, from `cache` (its state, or a fresh one), in
    pieces ending at `cuts` (a mixer call each); after those in `snap_at` (its marks) a copy of each layer's state
    goes to `snaps`."""

    def __init__(self, segment: int, cache, offset: int, cuts: tuple[int, ...], snap_at: frozenset):
        self.segment, self.cache, self.offset, self.cuts, self.snap_at = segment, cache, offset, cuts, snap_at
        self.snaps: dict[int, list] = {}  # piece end (tokens into the segment) -> the layers' states there


class Step:
    """One forward's recurrent work (module doc): built by `Mixers.step` from the batch's segments, read by every
    swapped mixer through the `PoolCache` (`recurrent`), closed by `finish`.

    `stepped`: the segments continuing a state by at most `STEP_MAX` tokens (any number, `stepwise`): each mixer
    runs them token by token, the t-th tokens of all of them as one call over their states stacked (a decode
    step is the case of one token each), copying a state where a mark is. Whether a segment is stepped depends on
    it alone (its state and length), so a request computes alike in any batch. The others run `Alone`."""

    def __init__(self, mixers: Mixers, segments: list[Segment]):
        self.mixers, self.segments = mixers, segments
        self.offsets, at = [], 0
        for s in segments:
            self.offsets.append(at)
            at += len(s.token_ids)
        self.stepped = sorted((i for i, s in enumerate(segments) if s.carry.state is not None
                               and (len(s.token_ids) <= STEP_MAX or mixers.stepwise)),
                              key=lambda i: -len(segments[i].token_ids))
        self.states = {i: list(segments[i].carry.state.layers) for i in self.stepped}  # as the forward goes
        # a stepped segment's marks: tokens into it -> the layers' states there, copied as the forward goes
        self.snaps = {i: {m - segments[i].start: [None] * len(mixers.kinds) for m in self._marks(segments[i])}
                      for i in self.stepped}
        # a drafted segment's states after each token but its last, kept (tokens into it -> the layers' states)
        self.kept = {i: {b: [None] * len(mixers.kinds) for b in _drafted(s)} for i, s in enumerate(segments)
                     if s.drafted}
        # the cache a stepped call reads its stacked layer from
        self.scratch = mixers.cache_with(None) if self.stepped else None
        self.alone: list[Alone] = []
        for i in sorted(set(range(len(segments))) - set(self.stepped)):
            s = segments[i]
            n = len(s.token_ids)
            marks = {m - s.start for m in self._marks(s)}
            cuts = sorted(marks | set(_drafted(s)) | (set(range(1, n)) if mixers.stepwise else set())) + [n]
            layers = s.carry.state.layers if s.carry.state is not None else None
            self.alone.append(Alone(i, mixers.cache_with(layers), self.offsets[i], tuple(cuts), frozenset(marks)))

    def _marks(self, s: Segment) -> list[int]:
        """The marks strictly inside segment `s` and before its draft, where its state is copied mid-segment."""
        if self.mixers.snapshots is None:
            return []
        end = s.start + len(s.token_ids) - s.drafted
        return [m for m in s.carry.marks if s.start < m < end + (s.drafted > 0)]

    def mix(self, module, original, hidden_states: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """The mixer `module` (of layer `module.layer_idx`) over the step's flat row `hidden_states [1, T, H]`."""
        kwargs.pop("kvql_plan", None)
        x = hidden_states[0]
        i = module.layer_idx
        if i in self.mixers.own_step:
            y = self._own(module, x, i)
            if y is not None:
                return y[None]
        if i in self.mixers.scans:
            y = self._scan(module, original, x, i, kwargs)
            if y is not None:
                return y
        out = torch.empty_like(x)
        if self.stepped:
            self._step(module, original, x, out, kwargs)
        for unit in self.alone:
            a = 0
            for b in unit.cuts:
                lo, hi = unit.offset + a, unit.offset + b
                out[lo:hi] = original(module, x[lo:hi][None], cache=unit.cache, attention_mask=None, **kwargs)[0]
                if b in unit.snap_at:
                    unit.snaps.setdefault(b, [None] * len(self.mixers.kinds))[i] = _clone_layer(unit.cache.layers[i])
                if b in self.kept.get(unit.segment, ()):
                    self.kept[unit.segment][b][i] = _clone_layer(unit.cache.layers[i])
                a = b
        return out[None]

    def _targets(self, i: int):
        """Layer `i` of every segment's state (a stepped one's as the forward goes, an alone one's in its cache),
        the tokens after which each is copied (its marks, its drafted tokens), and `copy(j, b, layer)`, which puts
        the copy `layer` of segment j's state after its token b where it goes (a snapshot, a kept draft state)."""
        segments, stepped = self.segments, set(self.stepped)
        units = {u.segment: u for u in self.alone}
        layers = [self.states[j][i] if j in stepped else units[j].cache.layers[i] for j in range(len(segments))]
        cuts = [set(self.snaps[j]) if j in stepped else set(units[j].snap_at) for j in range(len(segments))]
        for j, kept in self.kept.items():
            cuts[j] |= set(kept)

        def copy(j: int, b: int, layer) -> None:
            marks = self.snaps[j] if j in stepped else units[j].snaps
            if b in (self.snaps[j] if j in stepped else units[j].snap_at):
                marks.setdefault(b, [None] * len(self.mixers.kinds))[i] = layer
            if b in self.kept.get(j, ()):
                self.kept[j][b][i] = _clone_layer(layer)

        return layers, cuts, copy

    def _own(self, module, x: torch.Tensor, i: int) -> torch.Tensor | None:
        """Every segment through `module` (of layer `i`) by kvql's own computation (mixer_steps.py), each from its
        state in place, copied at its marks and drafted tokens; None where it does not take some state."""
        layers, cuts, copy = self._targets(i)
        lengths = [len(s.token_ids) for s in self.segments]
        return mixer_steps.run(module, self.mixers.own_step[i], x, self.offsets, lengths, layers, cuts,
                               lambda j, b: copy(j, b, _clone_layer(layers[j])))

    def _scan(self, module, original, x: torch.Tensor, i: int, kwargs: dict) -> torch.Tensor | None:
        """Every segment through the Mamba2 mixer `module` (of layer `i`) in one call of its own forward, its
        convolution and scan by kvql's kernels (ragged_scan.py); None where they do not take some state."""
        layers, cuts, copy = self._targets(i)
        states = ragged_scan.RaggedStates(module, layers, self.offsets, [len(s.token_ids) for s in self.segments],
                                          cuts)
        try:
            y = original(module, x[None], cache=states, attention_mask=None, **kwargs)
        except ragged_scan.Unsupported:
            return None
        for (j, b), (conv, recurrent) in states.saved.items():
            layer = _clone_layer(layers[j])
            layer.conv_states[0], layer.recurrent_states[0] = conv, recurrent
            copy(j, b, layer)
        return y

    def _step(self, module, original, x: torch.Tensor, out: torch.Tensor, kwargs: dict) -> None:
        """The stepped segments through `module`: token t of each (the longest first) in one call, their states
        stacked; a single one's state (or states of differing structure, one by one) updated in place."""
        i, segments = module.layer_idx, self.segments
        for t in range(len(segments[self.stepped[0]].token_ids)):
            active = [j for j in self.stepped if len(segments[j].token_ids) > t]
            layers = [self.states[j][i] for j in active]
            stacked = _stack_layers(layers) if len(layers) > 1 else None
            groups = [(active, stacked)] if stacked is not None else [([j], layer) for j, layer in zip(active, layers)]
            for members, layer in groups:
                rows = torch.tensor([self.offsets[j] + t for j in members])
                self.scratch.layers[i] = layer
                y = original(module, x.index_select(0, rows)[:, None], cache=self.scratch, attention_mask=None,
                             **kwargs)
                out.index_copy_(0, rows, y[:, 0])
            if stacked is not None:
                for j, own in zip(active, _split_layer(stacked, layers)):
                    self.states[j][i] = own
            self._snap(active, t, i)
        self.scratch.layers[i] = None

    def _snap(self, active: list[int], t: int, i: int) -> None:
        """Layer `i`'s state copied for the stepped segments `active` with a mark or a drafted token after their
        token `t`."""
        for j in active:
            if t + 1 in self.snaps[j]:
                self.snaps[j][t + 1][i] = _clone_layer(self.states[j][i])
            if t + 1 in self.kept.get(j, ()):
                self.kept[j][t + 1][i] = _clone_layer(self.states[j][i])

    def finish(self) -> None:
        """Each request's state after its segment (`Carry.state`, `.length`) and the snapshots at its marks."""
        mixers = self.mixers
        for j in self.stepped:
            self._put(self.segments[j], self.snaps[j])
            self._carry(j, RecurrentState(self.states[j]))
        for unit in self.alone:
            s = self.segments[unit.segment]
            self._put(s, unit.snaps)
            self._carry(unit.segment, RecurrentState([unit.cache.layers[i] if i in mixers.recurrent else None
                                                      for i in range(len(mixers.kinds))]))

    def _put(self, s: Segment, snaps: dict[int, list]) -> None:
        for b, layers in snaps.items():
            self.mixers.snapshots.put(s.carry.salt, s.carry.tokens[:s.start + b], RecurrentState(layers))

    def _carry(self, j: int, state: RecurrentState) -> None:
        """Segment `j`'s request's state after it (and those kept after its drafted tokens)."""
        s = self.segments[j]
        carry, end = s.carry, s.start + len(s.token_ids)
        carry.state, carry.length = state, end
        keep = self.kept.get(j, {})
        carry.drafted = {s.start + b: RecurrentState(self._full(layers, state)) for b, layers in keep.items()}
        snapshots = self.mixers.snapshots
        if snapshots is not None and end in carry.marks and not s.drafted:
            snapshots.put(carry.salt, carry.tokens[:end], state.clone())

    def _full(self, kept: list, state: RecurrentState) -> list:
        """Kept layers, and None for the non-recurrent ones, as `state` has them."""
        return [kept[i] if i in self.mixers.recurrent else None for i in range(len(state.layers))]


class Mixers:
    """A hybrid model's recurrent mixers, swapped for the ragged path (module doc). `stepwise` and `snapshots` as
    own_forward.OwnForward's (the engine sets `snapshots`)."""

    def __init__(self, hf_model, kinds: tuple[str, ...], mixers: dict[int, torch.nn.Module], snapshots=None):
        self.model, self.kinds, self.modules, self.snapshots = hf_model, kinds, mixers, snapshots
        self.recurrent = sorted(mixers)
        # the layers kvql computes itself (mixer_steps.py); the others by the model's code
        self.own_step = {i: kind for i, m in mixers.items() if (kind := mixer_steps.form(m)) is not None}
        # Mamba2 mixers: their own forward over the whole batch, the state work by kvql's kernels (ragged_scan.py)
        self.scans = frozenset(i for i, m in mixers.items() if i not in self.own_step and ragged_scan.supports(m))
        for i in self.scans:
            ragged_scan.install(mixers[i])
        self.stepwise = False
        prepare(mixers)

    def decode_state(self, description: dict, tensors: dict[str, torch.Tensor]) -> RecurrentState:
        """A snapshot read back from the disk tier (`RecurrentState.decode`)."""
        return RecurrentState.decode(self.model.config, description, tensors)

    def step(self, segments: list[Segment]) -> Step:
        for s in segments:
            if s.carry is None:
                raise RuntimeError("a segment of a model with recurrent layers without its request's state")
            if s.carry.length != s.start:
                raise RuntimeError(f"a recurrent state after {s.carry.length} tokens, for a segment from token "
                                   f"{s.start}")
        return Step(self, segments)

    def cache_with(self, layers: list | None):
        """A transformers cache laid out as the config says, its recurrent layers `layers[i]` (None: fresh)."""
        cache = admission.config_cache(self.model.config)
        if layers is not None:
            for i in self.recurrent:
                cache.layers[i] = layers[i]
        return cache


def _drafted(s: Segment) -> range:
    """Where a drafted segment's states are kept (tokens into it): after its first token and each drafted one but
    the last, the lengths a verification may accept."""
    n = len(s.token_ids)
    return range(n - s.drafted, n)


def _stack_layers(layers: list):
    """One cache layer holding `layers` (one request's each) stacked along the batch axis: their tensors of batch 1
    concatenated; a scalar tensor (a layer's token count) the first's. None where they differ in structure or in
    any other value."""
    if any(type(layer) is not type(layers[0]) for layer in layers):
        return None
    try:
        values = {name: _stack([vars(layer)[name] for layer in layers]) for name in vars(layers[0])}
    except (KeyError, _Differ):
        return None
    stacked = copy.copy(layers[0])
    stacked.__dict__ = values
    return stacked


class _Differ(Exception):
    pass


def _stack(values: list):
    first = values[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return first.clone()
        if first.shape[0] != 1 or any(not isinstance(v, torch.Tensor) or v.shape != first.shape for v in values):
            raise _Differ
        return torch.cat(values)
    if isinstance(first, dict):
        if any(not isinstance(v, dict) or v.keys() != first.keys() for v in values):
            raise _Differ
        return {k: _stack([v[k] for v in values]) for k in first}
    if any(type(v) is not type(first) or isinstance(v, (list, tuple)) and v or v != first for v in values):
        raise _Differ
    return first


def _split_layer(stacked, before: list) -> list:
    """Each request's layer from a stacked one after a call: views of its row of the stacked tensors; a scalar
    tensor (a token count) its own before the call plus what the call added."""
    out = []
    for b, old in enumerate(before):
        own = copy.copy(stacked)
        own.__dict__ = {name: _row(value, b, vars(old)[name], vars(before[0])[name])
                        for name, value in vars(stacked).items()}
        out.append(own)
    return out


def _row(value, b: int, old, first):
    if isinstance(value, torch.Tensor):
        return old + (value - first) if value.dim() == 0 else value[b:b + 1]
    if isinstance(value, dict):
        return {k: _row(v, b, old[k], first[k]) for k, v in value.items()}
    return value
