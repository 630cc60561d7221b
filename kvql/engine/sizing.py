"""How a cache budget in bytes is shared: K/V slots for tokens, and for a model with recurrent layers the snapshots
of their states (a quarter) and the states of the requests running at once (at most a quarter: fewer run at
once where a quarter holds fewer). The engine is built from the budget (`Engine(cache_budget=...)`); the default is
a quarter of free memory on CPU (at most 4 GiB), half of it on CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache.kv_pool import KVPool
from .model import admission, model_runner

SNAPSHOT_SHARE = 4  # a model with recurrent layers keeps snapshots of their states in 1/4 of its cache budget


@dataclass(frozen=True)
class Sizes:
    geometry: admission.Geometry
    num_slots: int
    snapshot_bytes: int
    max_running: int


def default_budget(device: torch.device) -> int:
    """A quarter of free memory (at most 4 GiB) on CPU; half of free memory on CUDA."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = 4 * 2**30
    return min(available // 4, 4 * 2**30)


def size(hf_model, budget: int, max_running: int) -> Sizes:
    """The shares of `budget` for `hf_model` (module doc); its geometry read on the way (`UnsupportedModel`, a
    ValueError, says why the engine cannot run it). ValueError where the budget holds no token."""
    geometry = model_runner.read_geometry(hf_model)
    slot_bytes = KVPool.slot_bytes(num_layers=len(geometry.layers), kv_heads=geometry.kv_heads,
                                   head_dim=geometry.head_dim, v_dim=geometry.v_dim, dtype=hf_model.dtype)
    snapshot_bytes = budget // SNAPSHOT_SHARE if geometry.recurrent else 0
    if geometry.state_bytes:
        max_running = max(1, min(max_running, budget // SNAPSHOT_SHARE // geometry.state_bytes))
    left = budget - snapshot_bytes - max_running * geometry.state_bytes
    if left < slot_bytes:
        raise ValueError(f"cache_budget {budget} bytes holds no token ({slot_bytes} bytes per token)")
    return Sizes(geometry, left // slot_bytes, snapshot_bytes, max_running)
