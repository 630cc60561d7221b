"""Admission: whether and how a transformers model runs on the engine, judged by what its forward does, not by
its name.

The engine runs a model one of two ways (`Geometry.own`):
- **ragged** (the fast path): every attention layer writes its new K/V through `cache.update(key, value,
  layer_idx)` of the cache object it is given, then calls the attention function registered with transformers'
  `AttentionInterface` (with the forward's keyword arguments passed through), which attends over the pool as
  written, for every request of a batch in one forward. Most decoder-only families of transformers 5.x are
  written that way (Llama, Qwen, Gemma, Phi, OLMo, Granite, Cohere, StarCoder2, GPT-2, GPT-NeoX, GPT-J, GLM,
  gpt-oss, their MoE variants).
- **own** (the exact fallback): the model's own forward, one request at a time, over a transformers cache laid
  out as its config says, filled with the request's cached K/V from the pool, its new tokens' K/V copied back
  to their slots (own_forward.py). Whatever the model attends with (K/V transformed after `cache.update`,
  attention that bypasses the interface) is the model's own code; the pool holds what the model caches, per
  token, whatever its shape (`Layer.v_dim`).
kvql's own attention modules put two kinds the interface alone would send to the own forward on the ragged path:
ALiBi (alibi_attention.py) and MLA in its absorbed form (latent_attention.py: one latent key per token).
Recurrent layers (Mamba, Gated DeltaNet, LFM2's convolutions: `Geometry.recurrent`, `kinds`) keep their state per
request between its steps, and snapshots of it serve prefixes (cache/state_snapshots.py). A hybrid whose attention
layers pass the probe runs on the ragged path, its recurrent mixers per request (recurrent_mixers.py; the probe
then expects K/V from exactly the layers its own cache holds K/V for: `Geometry.kv_layers`); else on its own
forward.

`check_config` refuses, before the weights load, what neither way serves: encoder-decoder models. `own_reason`
names what the config alone shows the ragged path's attention does not compute: recurrent layers (a `layer_types`
kind whose cache in transformers is a recurrent or convolutional state: the ragged path then runs only with their
mixers swapped), a `layer_types` kind but full, sliding and chunked attention.

`probe(model)` runs one forward of a few tokens with a recording cache and records, per layer, what the
attention function receives: query heads, KV heads, head dim, the layer's sliding window, logit soft-cap and
sinks, and from the config its chunked attention's chunk (`layer_types`: Llama 4's; `Geometry`, which sizes the KV pool and tells the attention path each layer's variant); where the model
does not behave as the ragged path needs, it raises `UnsupportedModel` saying why, and `own_geometry` reads what
the model's own forward caches per layer instead (refusing with both reasons where that fails too).

`verify` (model_runner.ModelRunner.verify) then checks the chosen path numerically, once per engine: the logits
of a sequence whose first part is computed and written to the pool, then a chunk over it read back as cached KV,
then a few one-token steps (load_check.py: `verify_plan`, `compare`), must equal those of one plain forward of the same tokens (to
rounding). The sequence runs past every window and chunk the model declares. This catches anything the probe
cannot see (state kept outside the cache, attention arguments or masks the ragged path ignores); a ragged path
that fails it falls back to the model's own forward, checked the same way. A model that fails it on its own
forward is refused with the reason: only where its forward depends on more than its cache holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROBE_TOKENS = 6
SINKS = ("s_aux", "sinks")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")  # the ragged path's kinds


class UnsupportedModel(ValueError):
    """The model cannot run on the engine; the message says what it does that the engine cannot serve."""


@dataclass(frozen=True)
class Layer:
    """What one attention layer computes: `heads` query heads over `kv_heads` K/V heads of `head_dim`,
    each query seeing its last `window` positions (None: all), scores soft-capped at `softcap` (None: not),
    `sinks`: a learned logit per query head in each softmax's denominator (gpt-oss's `s_aux`), `alibi`: ALiBi's
    slope per head times each key's position added to its score (Bloom's, MPT's), `chunk`: each
    query seeing only the positions of its own chunk of `chunk` (chunked attention, Llama 4's; None: not).
    `v_dim`: the width of what the layer caches as values, where it differs from its keys' (`own` geometries:
    MLA's rotary key part; 0: `latent`'s). `latent`: MLA in its absorbed form (latent_attention.py): one KV head
    caching MLA's latent and rotary key part as its key, whose first `latent` dims are its values, held once."""

    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    v_dim: int | None = None
    chunk: int | None = None
    alibi: bool = False
    latent: int | None = None


@dataclass(frozen=True)
class Geometry:
    """The model's attention layers, in `layer_idx` order. The pool holds one K/V shape for all of them. `own`:
    None where the ragged path runs the model, else why the model's own forward does (module doc)."""

    layers: tuple[Layer, ...]
    own: str | None = None
    kinds: tuple[str, ...] | None = None  # `layer_kind` of each of the model's cache layers (own path, hybrids)
    state_bytes: int = 0  # the recurrent state one request holds while it runs (all its recurrent layers)

    @property
    def kv_layers(self) -> tuple[int, ...] | None:
        """The model's layer index of each pool layer, where they differ (a hybrid's); None: the same."""
        if self.kinds is None:
            return None
        return tuple(i for i, kind in enumerate(self.kinds) if "kv" in kind)

    @property
    def recurrent(self) -> bool:
        """Some layer keeps a recurrent state (a hybrid or recurrent model: states carried per request and
        snapshots of them in the cache; on the ragged path its mixers run as recurrent_mixers.py says)."""
        return any("state" in kind for kind in self.kinds or ())

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.layers[0].v_dim is None else self.layers[0].v_dim

    @property
    def latent(self) -> frozenset[int]:
        """The MLA layers in their absorbed form (`Layer.latent`), by index."""
        return frozenset(i for i, x in enumerate(self.layers) if x.latent)

    @property
    def kv_heads(self) -> int:
        return self.layers[0].kv_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].head_dim

    @property
    def heads(self) -> int:
        return self.layers[0].heads


class Probe:
    """The `kvql_plan` of a probe forward: the attention function records each call here."""

    def __init__(self):
        self.updates: list[tuple[int, tuple, tuple]] = []  # (layer_idx, key shape, value shape) in call order
        self.calls: list[dict] = []
        self.lengths: list[int] = []  # the layers that asked the cache for their past's length


class ProbeCache:
    """`cache=` of a probe forward: records each layer's K/V shape and hands the fresh K/V back (no past);
    `recurrent`: what computes a hybrid's recurrent mixers (recurrent_mixers.Fresh), None for other models."""

    def __init__(self, probe: Probe, recurrent=None, latent: frozenset[int] = frozenset()):
        self.probe, self.recurrent, self.latent = probe, recurrent, latent

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx in self.latent:  # an MLA layer's latent and rotary key part: one key, no value (as PoolCache)
            key_states = torch.cat([key_states, value_states], dim=-1)
            self.probe.updates.append((layer_idx, tuple(key_states.shape), (*key_states.shape[:-1], 0)))
            return key_states, None
        self.probe.updates.append((layer_idx, tuple(key_states.shape), tuple(value_states.shape)))
        return key_states, value_states

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0  # no past (as `get_seq_length`)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        if layer_idx is not None:  # a layer's own question (a model's, for its positions, passes none)
            self.probe.lengths.append(layer_idx)
        return 0  # no past: a probe forward is all new tokens


def record(probe: Probe, query, key, value, kwargs) -> None:
    """Called by the engine's attention function when its plan is a `Probe`."""
    sinks = {k: kwargs[k] for k in SINKS if kwargs.get(k) is not None}
    probe.calls.append({"heads": query.shape[1], "kv_heads": key.shape[1], "head_dim": key.shape[-1],
                        "v_dim": value.shape[-1], "window": kwargs.get("sliding_window"),
                        "softcap": kwargs.get("softcap"), "sinks": sorted(sinks),
                        "alibi": kwargs.get("alibi") is not None, "latent": kwargs.get("latent")})


def check_config(config) -> None:
    """Refusals that the config alone shows, before any weights are loaded (module doc)."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{config.model_type!r} is an encoder-decoder model; kvql's engine runs "
                               f"decoder-only language models")


def own_reason(config) -> str | None:
    """Why the config alone shows that the ragged path's attention would compute the model otherwise than the
    model does (so that its own forward runs it), or None."""
    stateful = sorted(set(recurrent_layer_types(config)))
    if stateful:
        return f"layers of type {', '.join(stateful)} (a recurrent or convolutional state in transformers' cache)"
    text = config.get_text_config()
    unknown = sorted({t for t in getattr(text, "layer_types", None) or [] if t not in ATTENTION_LAYER_TYPES}, key=str)
    if unknown:
        return (f"layers of type {', '.join(map(str, unknown))} (the ragged path computes "
                f"{' and '.join(ATTENTION_LAYER_TYPES)})")
    return None


def recurrent_layer_types(config) -> list[str]:
    """The entries of the config's `layer_types` that transformers' own cache serves with a recurrent state
    (a cache layer class of its `LinearAttentionCacheLayerMixin` kind: Mamba, Jamba, LFM2, Qwen3-Next, ...)."""
    from transformers import cache_utils

    mapping = getattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", {})
    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    declared = getattr(config.get_text_config(), "layer_types", None) or []
    return [t for t in declared if mixin is not None and isinstance(t, str)
            and isinstance(mapping.get(t), type) and issubclass(mapping[t], mixin)]


def probe(hf_model, forward, kinds: tuple[str, ...] | None = None, recurrent=None,
          own_attention: bool = False, latent: frozenset[int] = frozenset()) -> Geometry:
    """The geometry of `hf_model` (module doc), or UnsupportedModel. `forward(probe, cache, ids, positions)`
    runs the model's forward with the engine's attention function and `kvql_plan=probe`. `kinds`: a model with
    recurrent layers (`layer_kind` per layer, read from its own forward): its K/V layers are those that write K/V,
    its recurrent mixers run on the ragged path (recurrent_mixers.py), in the probe by `recurrent` (`ProbeCache`).
    `own_attention`: kvql's own attention modules (alibi_attention.py) call the engine's attention function, where
    transformers cannot set the model's attention implementation. `latent`: the layers whose MLA modules run in
    their absorbed form (latent_attention.prepare), whose caches are given latents."""
    config = hf_model.config
    name = config.model_type
    if not own_attention and not type(hf_model)._can_set_attn_implementation():
        raise UnsupportedModel(f"{name!r}: its attention does not go through transformers' AttentionInterface "
                               f"(transformers cannot set its attention implementation), which is where the "
                               f"engine reads and writes the KV cache")
    p = _recorded(hf_model, forward, name, recurrent, latent)
    layer_ids = _written(p, name, kinds, config)
    if layer_ids is None:  # recurrent layers only (Mamba): the pool holds a placeholder
        return Geometry((Layer(1, 1, 1),), kinds=kinds)
    text = config.get_text_config()
    types, size = getattr(text, "layer_types", None) or [], getattr(text, "attention_chunk_size", None)
    chunks = [size if i < len(types) and types[i] == "chunked_attention" else None for i in layer_ids]
    layers = [_layer(name, i, k_shape, v_shape, call, chunk)
              for (i, k_shape, v_shape), call, chunk in zip(p.updates, p.calls, chunks)]
    shapes = {(x.heads, x.kv_heads, x.head_dim) for x in layers}
    if len(shapes) > 1:
        raise UnsupportedModel(f"{name!r}: its layers differ in (heads, KV heads, head dim): {sorted(shapes)}; "
                               f"the engine's KV pool holds one shape for every layer")
    if layers[0].heads % layers[0].kv_heads:
        raise UnsupportedModel(f"{name!r}: {layers[0].heads} query heads over {layers[0].kv_heads} KV heads")
    return Geometry(tuple(layers), kinds=kinds)


def _recorded(hf_model, forward, name: str, recurrent, latent: frozenset[int]) -> Probe:
    """What one forward of `PROBE_TOKENS` tokens through the engine's attention function recorded (`probe`)."""
    p = Probe()
    ids = torch.arange(1, PROBE_TOKENS + 1) % int(hf_model.config.get_text_config().vocab_size)
    try:
        forward(p, ProbeCache(p, recurrent, latent), ids, torch.arange(PROBE_TOKENS))
    except AttributeError as e:
        if not isinstance(e.obj, ProbeCache):
            raise UnsupportedModel(f"{name!r}: a forward through the engine's cache failed ({e})") from e
        raise UnsupportedModel(f"{name!r}: its layers ask the cache for {e.name!r}, which a KV cache does not "
                               f"have: a recurrent (or convolutional) state, which is not a prefix of "
                               f"token-granular KV") from e
    except Exception as e:  # noqa: BLE001 -- any failure of the probe is the reason for refusing
        raise UnsupportedModel(f"{name!r}: a forward through the engine's cache failed "
                               f"({type(e).__name__}: {e})") from e
    return p


def _written(p: Probe, name: str, kinds: tuple[str, ...] | None, config) -> list[int] | None:
    """The layers that wrote K/V in the probe, in order, once every rule on them holds (else UnsupportedModel);
    None for a model of recurrent layers only."""
    if not p.updates and kinds is None:
        raise UnsupportedModel(f"{name!r}: no layer writes K/V through cache.update: a recurrent or otherwise "
                               f"stateful model (its state is not a prefix of token-granular KV)")
    layer_ids = [i for i, *_ in p.updates]
    if kinds is not None:
        want = [i for i, kind in enumerate(kinds) if "kv" in kind]
        if layer_ids != want:
            raise UnsupportedModel(f"{name!r}: its layers write K/V as layers {layer_ids} through the engine's "
                                   f"cache, where its own cache holds K/V of layers {want}")
        if not want:
            return None
    elif sorted(layer_ids) != list(range(len(layer_ids))):
        raise UnsupportedModel(f"{name!r}: its layers write K/V as layers {layer_ids}; the engine needs each "
                               f"attention layer to write its own (layers sharing K/V are not supported)")
    if len(p.calls) != len(p.updates):
        raise UnsupportedModel(f"{name!r}: {len(p.updates)} layers write K/V but the registered attention "
                               f"function was called {len(p.calls)} times: its attention does not pass the "
                               f"forward's keyword arguments through to the function registered with "
                               f"transformers' AttentionInterface")
    n_layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    if kinds is None and n_layers is not None and len(p.updates) < n_layers:
        raise UnsupportedModel(f"{name!r}: only {len(p.updates)} of its {n_layers} layers are attention layers "
                               f"with a KV cache; the others keep a recurrent state, which is not a prefix of "
                               f"token-granular KV (a hybrid model)")
    if p.lengths:
        raise UnsupportedModel(f"{name!r}: its layers {sorted(set(p.lengths))} ask the cache for the length of "
                               f"their past (Llama 4's attention temperature on NoPE layers), which a batch of "
                               f"requests at different positions does not have")
    return layer_ids


def _layer(name: str, i: int, k_shape: tuple, v_shape: tuple, call: dict, chunk: int | None) -> Layer:
    """Layer `i` as the probe saw it: what it wrote through cache.update (`k_shape`, `v_shape`) and what its
    attention call received (`call`), with the `chunk` its config declares; UnsupportedModel where the engine
    cannot attend as the layer does."""
    if (call["kv_heads"], call["head_dim"]) != (k_shape[1], k_shape[-1]):
        raise UnsupportedModel(f"{name!r}: layer {i} writes keys of {k_shape[1]} heads of {k_shape[-1]} to the "
                               f"cache but attends over {call['kv_heads']} of {call['head_dim']} (it transforms "
                               f"what it cached after cache.update: JetMoE repeats K/V per attention expert, "
                               f"DeepSeek's MLA expands a cached latent), where the engine's attention reads the "
                               f"pool as written")
    latent = call["latent"]
    if latent and not (call["v_dim"] == call["head_dim"] and k_shape[1] == 1 and v_shape[-1] == 0):
        raise UnsupportedModel(f"{name!r}: layer {i} attends over a latent in a form kvql does not read")
    if not latent and (call["v_dim"] != call["head_dim"] or k_shape[1:] != v_shape[1:]):
        raise UnsupportedModel(f"{name!r}: layer {i} has keys {k_shape} and values {v_shape} of different shapes")
    unread = sorted(set(call["sinks"]) - {"s_aux"})
    if unread:
        raise UnsupportedModel(f"{name!r}: layer {i} passes attention sinks as {', '.join(unread)}, which "
                               f"kvql's attention does not read (it reads gpt-oss's s_aux)")
    window = int(call["window"]) if call["window"] else None
    softcap = float(call["softcap"]) if call["softcap"] else None
    if window and chunk:
        raise UnsupportedModel(f"{name!r}: layer {i} has both a sliding window and chunked attention")
    return Layer(int(call["heads"]), int(call["kv_heads"]), int(call["head_dim"]), window, softcap,
                 bool(call["sinks"]), chunk=chunk, alibi=call["alibi"], v_dim=0 if latent else None,
                 latent=latent or None)


def config_cache(config):
    """A transformers `DynamicCache` laid out as the model's config says (a recurrent layer's state, a layer that
    caches nothing), as the model's own `generate` makes it; layers made lazily where the config names none."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config)
    except Exception:  # noqa: BLE001 -- a config transformers cannot lay a cache out for: layers made on use
        return DynamicCache()
    return cache if cache.layers else DynamicCache()


def layer_kind(layer) -> str:
    """What the own path keeps of one transformers cache layer: "kv" (K/V per token: the pool), "state" (a
    recurrent or convolutional state: carried per request, snapshots), "kv+state" (both: Falcon-H1's, Zamba2's
    hybrid layers), "none" (nothing: a layer without attention, or one reading another's K/V)."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    state = isinstance(layer, LinearAttentionCacheLayerMixin)
    kv = isinstance(layer, DynamicLayer) and getattr(layer, "keys", None) is not None
    return "kv+state" if kv and state else "kv" if kv else "state" if state else "none"


def own_geometry(hf_model, forward, reason: str) -> Geometry:
    """The geometry of `hf_model` run by its own forward (module doc): what each layer caches, read from the
    `config_cache` that `forward(cache, ids)` filled (ids at positions 0 ...) (`Geometry.kinds`: `layer_kind` per cache layer,
    `layers`: the K/V layers the pool holds); `reason`: why the ragged path does not run it. UnsupportedModel
    where its K/V layers differ in shape, or a layer's K/V is not one head set per token, or keeps only a window
    of it beside a recurrent state."""
    from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

    config = hf_model.config
    name = config.model_type
    cache = config_cache(config)
    try:
        forward(cache, torch.arange(1, PROBE_TOKENS + 1) % int(config.get_text_config().vocab_size))
    except Exception as e:  # noqa: BLE001 -- any failure of the forward is the reason for refusing
        raise UnsupportedModel(f"{name!r}: {reason}; and its own forward over a transformers DynamicCache failed "
                               f"({type(e).__name__}: {e})") from e
    kinds = tuple(layer_kind(layer) for layer in cache.layers)
    kv = [layer for layer, kind in zip(cache.layers, kinds) if "kv" in kind]
    windowed = [i for i, layer in enumerate(cache.layers) if isinstance(layer, DynamicSlidingWindowLayer)
                and isinstance(layer, LinearAttentionCacheLayerMixin)]
    if windowed:
        raise UnsupportedModel(f"{name!r}: {reason}; and its layers {windowed} keep a window of K/V beside a "
                               f"recurrent state, which kvql's own path does not carry")
    shapes = {(tuple(x.keys.shape), tuple(x.values.shape)) for x in kv}
    if not kv and "state" not in kinds:
        raise UnsupportedModel(f"{name!r}: {reason}; and its own forward caches nothing kvql can hold "
                               f"({[type(x).__name__ for x in cache.layers]})")
    if len(shapes) > 1:
        raise UnsupportedModel(f"{name!r}: {reason}; and its layers cache K/V of different shapes "
                               f"({sorted(shapes)}), where the pool holds one")
    if kv:
        k, v = next(iter(shapes))
        if k[0] != 1 or k[2] != PROBE_TOKENS or v[:3] != k[:3]:
            raise UnsupportedModel(f"{name!r}: {reason}; and its own forward caches keys {k} and values {v} for "
                                   f"{PROBE_TOKENS} tokens, not one head set per token")
        layer = Layer(k[1], k[1], k[3], v_dim=v[3] if v[3] != k[3] else None)
    else:  # recurrent layers only (Mamba): the pool holds one token's worth of nothing but a placeholder
        layer = Layer(1, 1, 1)
    state = sum(t.numel() * t.element_size() for x, kind in zip(cache.layers, kinds) if "state" in kind
                for name in ("conv_states", "recurrent_states") for t in (getattr(x, name, None) or {}).values()
                if isinstance(t, torch.Tensor))
    return Geometry((layer,) * max(len(kv), 1), own=reason, kinds=kinds, state_bytes=state)
