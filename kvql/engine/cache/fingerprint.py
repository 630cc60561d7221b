"""Fingerprint: what must match for KV kept on disk to be the KV this model would compute (disk_tier.py keeps
one directory per fingerprint, named by `digest`)."""

from __future__ import annotations

import hashlib
import json

import torch

SAMPLE = 4096
"""Elements hashed per weight tensor (a fixed stride over the whole tensor)."""


def fingerprint(hf_model, tokenizer, pool, file_format: str) -> dict[str, str]:
    """- `model`: SHA-256 over the config (minus names, paths, dtype and version fields) and, for every tensor of
      the state dict in name order, its name, shape, dtype and a fixed strided sample of `SAMPLE` elements spread
      over the whole tensor (first and last included). Hashing every weight of a 135M model would take ~0.3 s;
      the sample takes milliseconds and tells any two trained or randomly initialised models apart. Weights
      edited in a few places only (outside the sample) go unnoticed: give such a model its own cache directory.
    - `dtype` and `device` (the device type: KV computed by other kernels differs in the last bits), `kv`: the
      pool's layer/head geometry, `tokenizer`: SHA-256 of the vocabulary (token -> id), `format`: `file_format`.
    """
    h = hashlib.sha256()
    config = {k: v for k, v in hf_model.config.to_dict().items()
              if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in sorted(hf_model.state_dict().items()):
            flat = t.detach().reshape(-1)
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            if flat.numel():
                m = min(SAMPLE, flat.numel())
                index = torch.arange(m, device=flat.device) * (flat.numel() - 1) // max(m - 1, 1)
                sample = flat.index_select(0, index).cpu()  # (`flat[index]`: 100x slower)
                h.update(sample.contiguous().view(torch.uint8).numpy())
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    layers, kv_heads, _, head_dim = pool.k.shape
    kv = f"{layers}x{kv_heads}x{head_dim}" + (f"+{pool.v.shape[-1]}" if pool.v.shape[-1] != head_dim else "")
    return {"format": file_format, "model": h.hexdigest(), "dtype": str(pool.k.dtype).removeprefix("torch."),
            "device": pool.device.type, "kv": kv,
            "tokenizer": hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()}


def digest(fp: dict[str, str]) -> str:
    """The fingerprint's SHA-256 (hex). Its first 16 digits name a directory: two fingerprints sharing them would
    share it, and each file's full digest then tells their files apart."""
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()
