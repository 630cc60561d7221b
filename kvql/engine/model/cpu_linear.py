"""CPU linear layers: oneDNN-prepacked weights, and batch-invariant long reductions in reduced precision.

**Prepacking.** `torch.nn.functional.linear` on a CPU reorders the weight into the GEMM kernel's blocked
layout on every call. oneDNN can do that once (`torch.ops.mkldnn._reorder_linear_weight`, the op
torch's own inductor uses when it freezes a CPU model; vLLM's CPU backend prepacks the same way). Why:
the reorder is paid by every call of every layer, so it weighs most on a decode step, whose GEMMs are
small; a long prefill, whose GEMMs are large, gains less (measured: docs/benchmarks.md, Design
measurements). Outputs equal `linear`'s to ~1e-6 relative in fp32 (another kernel, another rounding;
fp32 stays exact in the project's sense: greedy output with the cache equals the uncached reference,
which runs through the same layers).

**Small batches** (`kernels/gemv.py`): a call of at most `gemv_rows` rows (a decode step of one stream, or a
few) reads a third, blocked copy of each weight slice through kvql's own kernel, which streams it near the
memory bandwidth. In bf16 it rounds bit for bit as oneDNN's prepacked GEMM (checked on each slice's real
weight when it is packed; a slice where it would not is left to oneDNN, with a warning), so a row's result
is the same whichever kernel its batch size picks: batch invariance holds. In fp32 it agrees with oneDNN to
float32 rounding (fp32 promises no batch invariance; its contract, cached == uncached greedy output, is
tested through the model). Cost: the linear weights take three times their memory. Why it pays: a
one-stream decode step's time is the time to read the weights, and this kernel reads them faster than
oneDNN's GEMM, in bf16 and fp32 (measured: docs/benchmarks.md, Design measurements).
Where oneDNN packs no bf16 weight (an AVX2-only CPU), a bf16 layer's blocked copy is computed by gemv's
widening kernel at every batch size instead of torch's plain kernel (one float32 chain per output, so a row
never depends on its batch; several times the plain kernel's speed at every batch size: gemv.py).

The packed copy is held beside the layer's own weight, which is kept, so the module stays an ordinary
`nn.Linear` (state dict, `.to()`, the cache fingerprint): the linear weights take twice their memory.
The packed copy follows the weight: it is rebuilt when the weight is edited in place (its version
counter moves) or replaced (`.to()`, `load_state_dict(assign=True)`), so a changed model never runs on
stale weights. (A weight created in inference mode has no version counter: edits made to it inside
inference mode go unseen.) A call that autograd records (grad enabled and an input or the weight
requiring grad) runs the plain kernel: the packed op has no backward; the engine runs under
`torch.inference_mode()`.

**Batch invariance** (`max_reduction`). Greedy decoding with the cache must give what the request alone
gives. In float32 the last-bit differences between GEMM shapes never flip a greedy token in the tests; in
bfloat16 they do. oneDNN's bf16 GEMM (plain and prepacked) computes each output row exactly as that row
alone whenever the reduction (`in_features`) is at most 1,024, whatever the batch size; above that
(SmolLM2's MLP `down_proj`, 1,536) a few rows in a batch round differently, depending on their place in
the batch (observed with torch 2.13; the runs and counts: docs/benchmarks.md, Design measurements). With
`max_reduction`, a layer with more inputs is computed as the sum of GEMMs over equal slices of at most
that many inputs, each batch-invariant, added in a fixed order, so the sum is too. That changes the layer's rounding (a
few ULPs, the same whatever the batch), not its arithmetic; its cost, more and narrower GEMMs, is a small
share of a decode step (measured: docs/benchmarks.md, Design measurements). The model runner asks for it on
a CPU in reduced precision only.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

from .kernels import gemv

MAX_REDUCTION = 1024
"""Longest reduction a bf16 GEMM row is batch-invariant over (module doc)."""

PACKED_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes oneDNN's prepacked linear may take; `can_pack(dtype)` says whether this CPU's oneDNN does."""

GEMV_ROWS = 8
"""Calls of at most this many rows, and at most `gemv.fast_rows` of their dtype, take the small-batch kernel
where a layer has its blocked copy (module doc): `gemv_rows`."""


def gemv_rows(dtype: torch.dtype) -> int:
    """The most rows a call in `dtype` takes gemv's kernel for where oneDNN holds the layer too."""
    return min(GEMV_ROWS, gemv.fast_rows(dtype))


def can_pack(dtype: torch.dtype | None = None) -> bool:
    """Whether this torch has oneDNN's prepacked linear (x86 and arm64 CPU builds do) and, given `dtype`,
    whether it packs weights of that dtype on this CPU: oneDNN's bf16 path needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT and raises without them, so an AVX2-only CPU computes bf16 layers with the plain kernel."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype is None or _packs(dtype)


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    if dtype not in PACKED_DTYPES:
        return False
    try:
        w = torch.zeros(64, 64, dtype=dtype)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 64, dtype=dtype), _packed(w), None, "none", [], "")
        return True
    except RuntimeError:
        return False


def _packable(w: torch.Tensor) -> bool:
    """Whether oneDNN packs weight `w` here: in CPU memory, of a dtype `can_pack` says it takes."""
    return w.device.type == "cpu" and can_pack(w.dtype)


def _own_kernel(w: torch.Tensor) -> bool:
    """Whether weight `w` runs gemv's widening bf16 kernel at every batch size: bf16 in CPU memory where oneDNN
    packs no bf16 weight and the kernel takes any number of rows (module doc)."""
    return (w.dtype == torch.bfloat16 and w.device.type == "cpu" and not can_pack(w.dtype)
            and gemv.any_rows(w.dtype))


def _packed(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous())


class _Packed:
    """A layer's slices, `(start, packed weight or None)` per reduction slice, the weights and biases they were
    packed from (`source`: `_watch`'s list, None for none), and (`Stacked`) the stacked bias. A copy or a pickle
    of the model carries none: oneDNN's packed tensors cannot be copied, and the copy packs its own weight at its
    first call."""

    def __init__(self, slices: list | None = None, source: list | None = None, bias: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None):
        self.slices, self.source, self.bias = slices or [], source, bias
        self.weight = weight  # `Stacked`'s stacked weight where it is not packed (the plain kernel reads it)

    def __deepcopy__(self, memo) -> _Packed:
        return _Packed()

    def __reduce__(self):
        return _Packed, ()


class Linear(torch.nn.Linear):
    """An `nn.Linear` computed from prepacked weight slices (module doc): kvql's replacement for a plain
    `nn.Linear`, made over that layer's own parameters (shared, not copied; the state dict is the same) by
    `packed(layer)`; `prepare` puts one in each plain layer's place, `restore` puts plain ones back. The replaced
    layer itself is left as it was. `step`: inputs per reduction slice (`in_features`: one slice); `prepack`: use
    oneDNN's prepacked kernel (else the plain kernel over views of the weight); `packs`: the slices."""

    def __init__(self, layer: torch.nn.Linear, step: int, prepack: bool):
        _over(self, layer)
        self.step, self.prepack = step, prepack
        self.repack()

    def repack(self) -> _Packed:
        w = self.weight
        pack = self.prepack and _packable(w)
        self.packs = _Packed(_slices(w, self.step, pack, self.prepack and _own_kernel(w)), _watch([self]))
        return self.packs

    def current_packs(self) -> _Packed:
        """The packed slices, packed again first if the weight or bias changed since, or this is a copy (module
        doc)."""
        packs = self.packs
        return packs if unchanged(packs.source) else self.repack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, packs = self.weight, self.current_packs()
        autograd = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)  # (oneDNN's op has no backward)
        out = _matmul(x, packs.slices, self.step, self.in_features, w, plain=autograd)
        return out if self.bias is None else out + self.bias


def _matmul(x: torch.Tensor, slices: list, step: int, n_in: int, w: torch.Tensor | None, plain: bool = False):
    """x times the weight given as reduction slices `(start, packed or None, blocked or None)` of `step`
    inputs each, summed in order: a slice with a blocked copy and no packed one takes gemv's kernel at every
    batch size (bf16 where oneDNN packs none); one without either, or all with `plain`, multiplies by `w`'s
    columns; one with both takes the small-batch kernel for up to `gemv_rows` rows, oneDNN's above."""
    out = None
    rows = x.numel() // n_in
    for a, packed, blocked in slices:
        xs = x if step == n_in else x[..., a:a + step]
        if blocked is not None and not plain and 0 < rows and (packed is None or rows <= gemv_rows(x.dtype)):
            y = gemv.gemv(xs.reshape(rows, step).contiguous(), blocked).view(*x.shape[:-1], -1)  # (Mamba: transposed)
        elif packed is None or plain:
            y = torch.nn.functional.linear(xs, w if step == n_in else w[:, a:a + step])
        else:
            y = torch.ops.mkldnn._linear_pointwise(xs, packed, None, "none", [], "")
        out = y if out is None else out + y
    return out


def _slices(w: torch.Tensor, step: int, pack: bool, own: bool = False) -> list:
    """`(start, packed copy or None without `pack`, blocked copy or None)` for each reduction slice of
    `step` inputs of `w` (module doc: beside a packed copy, the blocked copy where the kernel takes the slice
    and rounds as oneDNN does on it; with `own` and no packed copy, the blocked copy where the kernel takes
    the slice: it then computes the slice at every batch size)."""
    out = []
    for a in range(0, w.shape[1], step):
        ws = w[:, a:a + step]
        packed = _packed(ws) if pack else None
        if packed is not None:
            blocked = _blocked(ws, packed)
        else:
            blocked = gemv.pack(ws) if own and gemv.supports(ws) else None
        out.append((a, packed, blocked))
    return out


def _blocked(w: torch.Tensor, packed: torch.Tensor) -> torch.Tensor | None:
    """gemv's copy of `w`, if the kernel takes it and (bf16) its rows equal oneDNN's on `packed` bit for bit on
    a random input (else None, with a warning: the layer then runs oneDNN's kernel at every batch size)."""
    if not (gemv.supports(w) and gemv_rows(w.dtype) > 0):
        return None
    if w.dtype == torch.bfloat16 and not gemv.rounds_as_onednn():
        return None  # the widening kernel rounds otherwise: oneDNN's at every batch size
    with torch.inference_mode():
        blocked = gemv.pack(w)
        if w.dtype == torch.float32:  # no bit-for-bit promise in fp32 (module doc)
            return blocked
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
        if torch.equal(gemv.gemv(x, blocked), torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")):
            return blocked
    warnings.warn(f"kvql: the small-batch kernel does not round as oneDNN on a {tuple(w.shape)} weight; "
                  "that layer runs oneDNN's kernel at every batch size")
    return None


def _step(n: int, max_reduction: int | None) -> int:
    """Inputs per reduction slice: equal slices of at most `max_reduction` (module doc)."""
    return math.ceil(n / math.ceil(n / max_reduction)) if max_reduction and n > max_reduction else n


def _watch(modules: list[torch.nn.Linear]) -> list[tuple]:
    """What `unchanged` checks: each weight and bias of `modules`, as it is now."""
    out = []
    for m in modules:
        for name in ("weight", "bias"):
            t = m._parameters.get(name)  # the dict itself is watched: Module.__getattr__ is slow per call
            # an inference tensor has no version counter; it cannot be edited outside inference mode
            out.append((m._parameters, name, t, None if t is None else t.data_ptr(),
                        None if t is None or t.is_inference() else t._version))
    return out


def unchanged(watched: list[tuple] | None) -> bool:
    """Whether no tensor in `watched` (a `_Packed.source`; None: nothing watched, a copy's) was replaced, given new
    storage or edited in place since. Cheap, as a decode step checks every layer (the tensors' own identity,
    storage and version counter, read directly: comparing tuples of each tensor's data pointer, version, dtype
    and device took several times as long; measured: docs/benchmarks.md, Design measurements)."""
    if watched is None:
        return False
    for params, name, t, ptr, version in watched:
        if params.get(name) is not t or (t is not None and (t.data_ptr() != ptr or (
                version is not None and t._version != version))):
            return False
    return True


class Stacked:
    """Linear layers that read the same input (q/k/v projections, gate/up) computed as one GEMM:
    `stacked(x)` equals `cat([part(x) for part in parts], -1)` to float rounding (why: one GEMM over the
    stacked weight rows pays one call's fixed cost where several narrow ones pay one each; measured:
    docs/benchmarks.md, Design measurements). Prepacked where `can_pack(dtype)` (callers check `can_pack()`;
    else the plain kernel) and sliced for `max_reduction` as `Linear`. The packed copy follows the parts:
    rebuilt when a part's weight or bias is edited in place or replaced. Only the packed copy is held (the
    parts keep their own weights, unpacked: `prepare` leaves the parts alone: `skip`). Not a module: the
    model's state dict is unchanged; a copy or a pickle packs again at its first call."""

    def __init__(self, parts: list[torch.nn.Linear], max_reduction: int | None = None):
        self.parts, self.max_reduction = list(parts), max_reduction
        self.in_features = parts[0].in_features
        self.step = _step(self.in_features, max_reduction)
        self.repack()  # now, not at the first call: a fresh server's first requests do not pay it

    def __getstate__(self) -> dict:
        return {**self.__dict__, "packed": _Packed()}

    def repack(self) -> _Packed:
        with torch.no_grad():
            w = torch.cat([p.weight.detach() for p in self.parts])
            biases = [p.bias for p in self.parts]
            bias = None if all(b is None for b in biases) else torch.cat(
                [b.detach() if b is not None else w.new_zeros(p.out_features) for b, p in zip(biases, self.parts)])
            # one assignment: a thread calling meanwhile sees the old set or the new one, never a mix
            pack = _packable(w)
            self.packed = _Packed(_slices(w, self.step, pack, _own_kernel(w)), _watch(self.parts), bias,
                                  None if pack else w)
        return self.packed

    def current_packs(self) -> _Packed:
        """The packed slices, packed again first if a part changed since, or this is a copy."""
        packs = self.packed
        return packs if unchanged(packs.source) else self.repack()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packs = self.current_packs()
        out = _matmul(x, packs.slices, self.step, self.in_features, packs.weight)
        return out if packs.bias is None else out + packs.bias


def packed(layer: torch.nn.Linear, max_reduction: int | None = None, pack: bool | None = None) -> Linear:
    """A `Linear` over `layer`'s parameters computed from prepacked weights (`pack`; default: when `can_pack()`)
    and, with `max_reduction`, as a sum over slices of at most `max_reduction` inputs (module doc)."""
    return Linear(layer, _step(layer.in_features, max_reduction), can_pack() if pack is None else pack)


def plain(layer: Linear) -> torch.nn.Linear:
    """A plain `nn.Linear` over `layer`'s parameters (shared)."""
    return _over(torch.nn.Linear.__new__(torch.nn.Linear), layer)


def _over(module: torch.nn.Linear, layer: torch.nn.Linear) -> torch.nn.Linear:
    """`module` (not yet initialized) made a linear layer over `layer`'s parameters (shared, not copied), in its
    mode (training or not)."""
    torch.nn.Module.__init__(module)
    module.in_features, module.out_features = layer.in_features, layer.out_features
    module.register_parameter("weight", layer.weight)
    module.register_parameter("bias", layer.bias)
    return module.train(layer.training)


def prepare(model: torch.nn.Module, max_reduction: int | None = None, pack: bool | None = None,
            skip: list[torch.nn.Module] = ()) -> int:
    """Put a `packed` layer in the place of every `nn.Linear` of `model` (exactly that class; subclasses are left
    alone, as are layers with hooks: their hooks belong to them). Returns how many layers it set up or changed;
    calling it again with the same arguments changes nothing. Layers on other devices or in other dtypes keep the
    plain kernel (still sliced when asked). `skip`: layers left as they are (those that run inside a `Stacked`).
    Raises TypeError for a model that is itself a linear layer (nothing holds it to replace: `packed(layer)`)."""
    pack = can_pack() if pack is None else pack
    skipped = {id(m) for m in skip}

    def replace(module):
        if type(module) not in (torch.nn.Linear, Linear) or id(module) in skipped or _hooked(module):
            return None
        step = _step(module.in_features, max_reduction)
        if type(module) is Linear and module.step == step and module.prepack == pack:
            return None
        return Linear(module, step, pack)

    return _replace(model, replace)


def restore(model: torch.nn.Module) -> int:
    """Undo `prepare`: a plain `nn.Linear` in each `Linear`'s place (e.g. a plain transformers baseline from a copy
    of an engine's model). Returns how many."""
    return _replace(model, lambda module: plain(module) if type(module) is Linear else None)


def _replace(model: torch.nn.Module, replacement) -> int:
    """Each child `c` of `model`'s modules for which `replacement(c)` is a module replaced by it (one replacement
    per module, wherever it is held); returns how many modules were replaced."""
    if type(model) in (torch.nn.Linear, Linear):
        raise TypeError("prepare and restore replace a model's linear layers in their parents; a single layer: "
                        "cpu_linear.packed(layer) / cpu_linear.plain(layer)")
    made: dict[int, torch.nn.Module | None] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) not in made:
                made[id(child)] = replacement(child)
            if made[id(child)] is not None:
                setattr(parent, name, made[id(child)])
    return sum(m is not None for m in made.values())


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)
