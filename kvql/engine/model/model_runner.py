"""Model runner: one forward of a Hugging Face causal LM over a ragged batch, KV in the pool.

All new tokens of all requests are flattened to one `[1, T]` row with per-request `position_ids`.
A `PoolCache` passed as the model's `cache=` writes each layer's new K/V into the pool slots given
for those tokens; the registered attention function (pool_attention.py) then runs the `attention_plan` for the batch:
each token sees exactly its own request's slots up to itself. On a CPU (fp32/bf16, where the paged
kernel builds) every segment reads its slots in place through `paged_attention`: a token's attention then
depends only on its own query and keys, in any batch, chunking or cache state. Elsewhere (CUDA, fp16, no C
compiler) prompts without a cached past attend in place over the layer's fresh K/V (causal SDPA, nothing
gathered) and the others gather their slots from the pool per bucket: in fp32 a prefix shared by many
requests is gathered and multiplied once for all of them; in reduced precision (`batch_invariant`) every
request, prompts included, attends over exactly its own keys padded to a length set by its own key count
(attention_plan's module doc). Cached keys were rotated at their own positions when computed (RoPE), so
any slot order is valid.

Works for any model on the standard transformers path: attention modules that call
`cache.update(k, v, layer_idx, ...)` and then the registered attention function; `read_geometry` probes a
model for it (kvql.engine.model.admission) and reads each layer's heads, window and soft-cap, which the attention
function also receives per call (`sliding_window`, `softcap`, `scaling`) and applies on every path.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .attention_plan import plan
from . import (admission, alibi_attention, cpu_linear, fused_layers, latent_attention, lean_model, load_check,
               own_forward, recurrent_mixers)
from .kernels import paged_attention
from .pool_attention import NO_MASK, ATTENTION, PoolCache
from ..segment import Carry, Segment

# a model with recurrent layers continues a state one token per forward where a chunk's logits differ from the
# model's own more than this many times as much as one token per forward's (Jamba in bf16: 0.015 vs 0.0075;
# its chunked torch path continues a state inexactly; the families whose chunks are exact: 0.6-1.3x)
STEPWISE_MARGIN = 1.5


def read_geometry(hf_model) -> admission.Geometry:
    """How the engine runs `hf_model` (admission's module doc): the ragged path's geometry where its probe
    admits the model (the model's attention implementation then set to the engine's: a plain forward of it runs
    as before), else what the model's own forward caches (`Geometry.own` says why); UnsupportedModel where
    neither serves it."""
    config = hf_model.config
    admission.check_config(config)
    reason = admission.own_reason(config)
    own, mixers = None, None
    if reason is not None and admission.recurrent_layer_types(config):  # a hybrid: its mixers on the ragged path
        own = own_forward.geometry(hf_model, reason)
        mixers = recurrent_mixers.find(hf_model, own.kinds)
        if mixers is None:
            return own
    if reason is None or mixers is not None:
        original = config._attn_implementation
        if type(hf_model)._can_set_attn_implementation():
            hf_model.set_attn_implementation(ATTENTION)
        alibi, latent = alibi_attention.prepare(hf_model), latent_attention.prepare(hf_model)

        @torch.inference_mode()
        def forward(probe, cache, ids, positions):
            dev = next(hf_model.parameters()).device
            hf_model(input_ids=ids[None].to(dev), position_ids=positions[None].to(dev),
                     attention_mask=None if alibi else NO_MASK.to(dev), cache=cache, kvql_plan=probe,
                     logits_to_keep=1)

        if mixers is not None:
            recurrent_mixers.prepare(mixers)
        try:
            geometry = admission.probe(hf_model, forward, own and own.kinds, mixers and recurrent_mixers.Fresh(config),
                                       own_attention=alibi, latent=latent)
            return dataclasses.replace(geometry, state_bytes=own.state_bytes) if own else geometry
        except admission.UnsupportedModel as e:
            reason = f"{reason}; on the ragged path: " if own else ""
            reason += str(e).removeprefix(f"{config.model_type!r}: ")
        if mixers is not None:
            recurrent_mixers.restore(mixers)
        alibi_attention.restore(hf_model)
        latent_attention.restore(hf_model)
        if type(hf_model)._can_set_attn_implementation():
            hf_model.set_attn_implementation(original)
    return own_forward.geometry(hf_model, reason)


class ModelRunner:
    def __init__(self, hf_model, pool, geometry: admission.Geometry | None = None, snapshots=None):
        """`geometry`: the model's (`read_geometry(hf_model)`), probed here when not given; `pool` (the engine's KV
        pool, handed in: the model room imports nothing of the cache) holds its K/V shape;
        `snapshots`: a model with recurrent layers' store of their states (cache/state_snapshots.py)."""
        self.model, self.pool, self.snapshots = hf_model, pool, snapshots
        self.device = pool.device
        self.geometry = geometry = geometry or read_geometry(hf_model)
        self.groups = geometry.heads // geometry.kv_heads
        # batch-invariant attention (attention_plan's module doc): on in reduced precision, where a
        # merged cluster's reduction order changes outputs; fp32 merges shared prefixes (cheaper)
        self.batch_invariant = pool.k.dtype != torch.float32
        self.lean, self.paged, self.own, self.chunks, self.mixers, self.mask = None, False, None, None, None, NO_MASK
        if geometry.own is None:
            if geometry.recurrent:
                self.mixers = recurrent_mixers.Mixers(hf_model, geometry.kinds,
                                                      recurrent_mixers.find(hf_model, geometry.kinds), snapshots)
            self._prepare_ragged()
        else:
            self.own = own_forward.OwnForward(hf_model, pool, geometry, snapshots)
            if self.device.type == "cpu":  # a GEMM row that never depends on its batch (prefill chunks may vary)
                cpu_linear.prepare(hf_model, max_reduction=cpu_linear.MAX_REDUCTION if self.batch_invariant else None)
        self.forward_seconds = 0.0
        self.forward_tokens = 0

    def _prepare_ragged(self) -> None:
        hf_model, pool, geometry = self.model, self.pool, self.geometry
        if type(hf_model)._can_set_attn_implementation():  # (Bloom's cannot: kvql's own modules, alibi_attention.py)
            hf_model.set_attn_implementation(ATTENTION)
        if self.device.type == "cpu":
            # prepacked weights; in reduced precision a GEMM row then never depends on its batch (cpu_linear.py)
            max_reduction = cpu_linear.MAX_REDUCTION if self.batch_invariant else None
            # fewer, larger operations per layer (q/k/v and gate/up GEMMs stacked, norms and rotary fused);
            # first, so that the stacked layers' parts are not packed only to be unpacked again
            fused_layers.prepare(hf_model, max_reduction=max_reduction)
            cpu_linear.prepare(hf_model, max_reduction=max_reduction, skip=fused_layers.stacked_parts(hf_model))
        # chunked attention's span per layer: the plan carries it to the attention function, which is not told
        layer_ids = geometry.kv_layers or range(len(geometry.layers))
        self.chunks = {i: x.chunk for i, x in zip(layer_ids, geometry.layers) if x.chunk} or None
        # the same forward without transformers' module calls, where the model's structure allows (lean_model.py)
        lean = self.device.type == "cpu" and not self.chunks and self.mixers is None
        self.lean = lean_model.build(hf_model) if lean else None
        self.mask = None if alibi_attention.takes_no_mask(hf_model) else NO_MASK  # the forward's attention mask
        self.paged = paged_attention.supports(self.device, pool.k.dtype, geometry.heads, geometry.kv_heads,
                                              pool.k.shape[-1])

    @property
    def states(self):
        """What carries a recurrent model's states between steps, with its `snapshots`, `stepwise` and
        `decode_state`: the own forward, or the ragged path's mixers; None for a model without recurrent layers."""
        return self.own if self.own is not None and self.geometry.recurrent else self.mixers

    @torch.inference_mode()
    def forward(self, segments: list[Segment]) -> list[torch.Tensor | None]:
        """Run the batch; return, per segment, its float32 logits: those of its last `logit_rows`
        tokens (`[len(token_ids), vocab]` with `all_logits`, `[1, vocab]` with `needs_logits` alone),
        or None when it wants none."""
        if self.own is not None:
            started = time.perf_counter()
            out = self.own(segments)
            self._count(started, sum(len(s.token_ids) for s in segments))
            return out
        dev = self.device
        ids, pos, rows, spans = [], [], [], []
        for s in segments:
            n = len(s.token_ids)
            ids.extend(s.token_ids)
            pos.append(torch.arange(s.start, s.start + n))
            k = s.logit_rows
            spans.append((len(rows), len(rows) + k))
            rows.extend(range(len(ids) - k, len(ids)))
        step_plan = plan(segments, self.groups, dev, merge=not self.batch_invariant, paged=self.paged,
                         chunks=self.chunks)
        started = time.perf_counter()
        write_slots = torch.cat([s.new_slots for s in segments])
        keep = torch.tensor(rows, dtype=torch.long, device=dev)
        if self.lean is not None and step_plan.paged is not None and self.lean.usable(self.pool.k.dtype):
            logits = self.lean.forward(torch.tensor(ids), torch.cat(pos), write_slots, step_plan, keep, self.pool)
        else:
            recurrent = self.mixers.step(segments) if self.mixers is not None else None
            out = self.model(
                input_ids=torch.tensor([ids], device=dev),
                position_ids=torch.cat(pos).to(dev)[None],
                attention_mask=None if self.mask is None else self.mask.to(dev),
                cache=PoolCache(self.pool, write_slots, step_plan, self.geometry.kv_layers, recurrent,
                                self.geometry.latent),
                logits_to_keep=keep,
                kvql_plan=step_plan,
            )
            logits = out.logits[0].float()
            if recurrent is not None:
                recurrent.finish()
        self._count(started, len(ids))
        return [logits[a:b] if b > a else None for a, b in spans]

    def _count(self, started: float, tokens: int) -> None:
        """A forward begun at `started` (perf_counter) computed `tokens`: in the engine's counters, once done."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - started
        self.forward_tokens += tokens

    def verify(self) -> None:
        """UnsupportedModel unless logits computed over KV read back from the pool equal one plain forward of
        the same tokens (load_check.verify_plan: a first part, a chunk over it, one-token steps, past every
        window and chunk); uses pool slots while it runs and returns them. A ragged path that fails the check
        gives way to the model's own forward (where it caches what the pool holds), checked the same way. A
        model with recurrent layers is checked for each way its own forward may continue a state
        (`_continuation`); on the ragged path its one-token steps also run beside a twin of the sequence, in one
        batch (its mixers' stacked states: recurrent_mixers.py)."""
        name = f"{self.model.config.model_type!r}: "
        try:
            self._continuation(name) if self.geometry.recurrent else self._verify()
        except admission.UnsupportedModel as e:
            if self.own is not None:
                raise
            self._own_instead(name, e)

    def _continuation(self, name: str) -> None:
        """How the model's own forward (or its mixers, on the ragged path) continues a recurrent state: by a chunk,
        unless its logits differ clearly more than one token per forward's (`stepwise`); UnsupportedModel naming
        both where neither is exact."""
        errors, failed = {}, {}
        for mode in ("chunk", "stepwise"):
            self.states.stepwise = mode == "stepwise"
            try:
                errors[mode] = self._verify()
            except admission.UnsupportedModel as e:
                failed[mode] = str(e).removeprefix(name)
        if not errors:
            raise admission.UnsupportedModel(f"{name}continuing a state by a chunk: {failed['chunk']}; and one token "
                                             f"per forward: {failed['stepwise']}")
        floor = load_check.tolerance(self.pool.k.dtype) / 100
        self.states.stepwise = "chunk" not in errors or errors["chunk"] > max(
            STEPWISE_MARGIN * errors.get("stepwise", float("inf")), floor)

    def _own_instead(self, name: str, failed: admission.UnsupportedModel) -> None:
        """The ragged path failed the check: the model's own forward, where it caches what the pool holds."""
        reason = str(failed).removeprefix(name)
        own = own_forward.geometry(self.model, f"the ragged path's check failed: {reason}")
        if self.geometry.latent and own.head_dim + own.v_dim == self.geometry.head_dim:
            self.pool.split_keys(own.head_dim)  # MLA's own forward caches the latent and rotary part apart
        if (own.kv_heads, own.head_dim, own.v_dim, len(own.layers)) != (
                self.pool.k.shape[1], self.pool.k.shape[-1], self.pool.v.shape[-1], self.pool.k.shape[0]):
            raise admission.UnsupportedModel(f"{name}{reason}; and its own forward caches other shapes than "
                                             f"its attention layers write") from failed
        if self.mixers is not None:
            recurrent_mixers.restore(self.mixers.modules)
        alibi_attention.restore(self.model)
        latent_attention.restore(self.model)
        self.geometry, self.lean, self.paged, self.mixers = own, None, False, None
        self.own = own_forward.OwnForward(self.model, self.pool, own, self.snapshots)
        try:
            self._continuation(name) if own.recurrent else self._verify()
        except admission.UnsupportedModel as again:
            raise admission.UnsupportedModel(f"{name}on the ragged path: {reason}; and on its own forward: "
                                             f"{str(again).removeprefix(name)}") from again

    @torch.inference_mode()
    def _verify(self) -> float:
        config = self.model.config
        first, rest = load_check.verify_plan(config, self.geometry, self.pool.num_free)
        if self.mixers is not None:  # the chunk long enough that the mixers continue its state by a chunk, not stepped
            rest = max(rest, min(recurrent_mixers.STEP_MAX + 1,
                                 self.pool.num_free - first - 2 * load_check.VERIFY_DECODES))
        n = first + rest + load_check.VERIFY_DECODES
        if rest < 1:
            return 0.0  # a pool smaller than the check: requests are refused by size anyway
        vocab = int(config.get_text_config().vocab_size)
        ids = [(7 * i + 3) % vocab for i in range(n)]
        slots, extra = self.pool.alloc(n), None
        counters = self.forward_seconds, self.forward_tokens  # the check is not the engine's work
        carry = Carry(tokens=ids) if self.geometry.recurrent else None  # the sequence's state, step to step
        try:
            none = torch.empty(0, dtype=torch.long, device=self.device)
            self.forward([Segment(ids[:first], 0, none, slots[:first], False, carry=carry)])
            rows = min(rest, load_check.VERIFY_ROWS)
            end = first + rest
            got = self.forward([Segment(ids[first:end], first, slots[:first], slots[first:end], True,
                                        logits_from=end - rows, carry=carry)])
            # a hybrid's mixers stack the states of one-token steps (recurrent_mixers.py): the steps also run for
            # a twin of the sequence in the same batch, whose logits must be the same
            twin = Carry(tokens=ids, state=carry.state.clone(), length=end) if self.mixers is not None else None
            extra = self.pool.alloc(n - end) if twin is not None else None
            twins = []
            for i in range(end, n):
                batch = [Segment(ids[i:i + 1], i, slots[:i], slots[i:i + 1], True, carry=carry)]
                if extra is not None:
                    batch.append(Segment(ids[i:i + 1], i, torch.cat([slots[:end], extra[:i - end]]),
                                         extra[i - end:i - end + 1], True, carry=twin))
                out = self.forward(batch)
                got.append(out[0])
                twins += out[1:]
        finally:
            self.pool.free(slots)
            if extra is not None:
                self.pool.free(extra)
            self.forward_seconds, self.forward_tokens = counters
        if self.geometry.recurrent:  # the one-token steps against the model's own steps, as its generate runs them
            want = self._own_steps(ids, end, rows)
        else:
            want = self.model(input_ids=torch.tensor([ids], device=self.device),
                              logits_to_keep=rows + load_check.VERIFY_DECODES).logits[0].float()
        rows += load_check.VERIFY_DECODES
        if twins:
            load_check.compare(config.model_type, torch.cat(twins), want[-len(twins):], self.pool.k.dtype, offset=end)
        return load_check.compare(config.model_type, torch.cat(got), want, self.pool.k.dtype, offset=n - rows)

    def _own_steps(self, ids: list[int], end: int, rows: int) -> torch.Tensor:
        """The logits of the last `rows` of `ids[:end]` by one plain forward, then of each later token by a
        one-token forward over transformers' own cache of everything before it: what the model's `generate`
        computes. A model with recurrent layers may compute a token as a step otherwise than inside a sequence
        (RecurrentGemma); the engine's steps must equal its `generate`'s."""
        cache = admission.config_cache(self.model.config)
        x = torch.tensor(ids, device=self.device)
        out = [own_forward.forward(self.model, cache, x[:end], rows, 0).logits[0]]
        out += [own_forward.forward(self.model, cache, x[i:i + 1], 1, i).logits[0] for i in range(end, len(ids))]
        return torch.cat(out).float()
