"""`kvql.model(spec)`: a backend for a model spec, local or remote (`kvql.model` and `kvql.tokenizer`)."""

from __future__ import annotations

_random_models: dict = {}


def tokenizer(spec: str = "smollm2-135m"):
    """The Hugging Face tokenizer of model `spec` (as `model` reads specs), without loading the model."""
    from .loader import load_tokenizer

    return load_tokenizer(spec)


def model(spec: str = "smollm2-135m", *, device: str = "cpu", dtype=None, cache_budget: int | str | None = None,
          max_batch_tokens: int = 1024, max_running: int = 64, name: str | None = None, api_key: str | None = None,
          tokenizer=None, seed: int | None = None, silent: bool = True):
    """Load a model for kvql's engine, or connect to a server.

    `spec`: `"smollm2-135m"` (the embedded default), a local Hugging Face model directory
    (optionally `"local:PATH"`), or `"http(s)://HOST:PORT/v1"`: an OpenAI-compatible server (kvql serve,
    vLLM, SGLang) serving model `name`; `tokenizer=` (a tokenizer, a model directory or spec) makes
    queries keep and send token ids there (default: the served model's name, when it names a local
    model; see `kvql.backends.remote`). `cache_budget`: bytes of KV cache (int, or `"512MB"`, `"2GiB"`);
    default a quarter of free memory, at most 4 GiB (CPU) or half of free GPU memory (CUDA).

    `"random"` (LMQL's test model, `seed=` as in LMQL; default 0) is a tiny random-weights Llama with
    SmolLM2's tokenizer (see `kvql.backends.loader.random_model`) and a 32 MB cache by default; calls with
    the same arguments share one instance. `silent` is accepted for LMQL code (kvql prints nothing on load).
    """
    if spec.startswith(("http://", "https://")):
        if seed is not None:
            raise TypeError("seed= is for the 'random' model; a server's model has fixed weights")
        from .remote import RemoteModel

        return RemoteModel(spec, name=name, api_key=api_key, tokenizer=tokenizer)
    if tokenizer is not None:
        raise TypeError("tokenizer= is for remote models; a local model uses its own")
    from .loader import load_hf, random_model
    from .local import Model

    if spec == "random":
        key = (seed or 0, device, dtype, cache_budget, max_batch_tokens, max_running, name)
        shared = _random_models.get(key)
        if shared is None or shared.closed:
            hf_model, tok = random_model(seed or 0, device=device, dtype=dtype)
            shared = _random_models[key] = Model(hf_model, tok, name=name or "random",
                                                 cache_budget=cache_budget or "32MB",
                                                 max_batch_tokens=max_batch_tokens, max_running=max_running)
        return shared
    if seed is not None:
        raise TypeError(f"seed= is for the 'random' model; model {spec!r} has fixed weights")
    hf_model, tok = load_hf(spec, device=device, dtype=dtype)
    return Model(hf_model, tok, name=spec, cache_budget=cache_budget, max_batch_tokens=max_batch_tokens,
                 max_running=max_running)
