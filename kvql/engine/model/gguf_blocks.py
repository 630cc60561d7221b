"""GGUF's quantized blocks as `qgemm`'s integers and per-group scales, without rounding anything.

`decode(type_name, raw, k)`: `raw` a tensor's bytes as the file holds them (`[n, bytes per row]` uint8, one row per
output), `k` its inputs; returns `(q [n, k], scale [n, k / group], min [n, k / group] or None)` (torch: int32,
float32, float32) with `scale * q + min` equal to the weight llama.cpp's dequantization gives, bit for bit in
float32 (tests/test_quantized.py checks it against the `gguf` package's), or None for a type it does not take:
- Q8_0: 32 int8 and a float16 d; w = d q (8-bit, groups of 32).
- Q5_0: 32 5-bit q and d; w = d (q - 16): 8-bit values q - 16, groups of 32.
- Q4_0: 32 4-bit q and d; w = d (q - 8): 4-bit, min -8 d.   Q4_1: w = d q + m: 4-bit, min m.
- Q4_K: 256 per super-block: float16 d and dmin, 8 sub-blocks of 32 with 6-bit scale sc and min mn;
  w = d sc q - dmin mn: 4-bit, scale d sc, min -dmin mn (each product exact in float32).
- Q6_K: 256 per super-block: 16 sub-blocks of 16 with an int8 scale, float16 d; w = d sc (q - 32): 8-bit values
  q - 32, groups of 16, scale d sc.
"""

from __future__ import annotations

import numpy as np
import torch

TYPES = ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


def _half(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 pairs of bytes (last axis 2) as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles16(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: low nibbles are values 0..15, high nibbles 16..31 (Q4_0, Q4_1, Q5_0)."""
    return np.concatenate([qs & 15, qs >> 4], -1).astype(np.int32)


def decode(type_name: str, raw: np.ndarray, k: int):
    if type_name not in TYPES:
        return None
    n = raw.shape[0]
    if type_name.endswith("_K"):
        b = raw.reshape(n, k // 256, -1)
    else:
        b = raw.reshape(n, k // 32, -1)
    if type_name == "Q8_0":
        d, q = _half(b[..., 0:2]), b[..., 2:34].copy().view(np.int8).astype(np.int32)
        scale, mins = d, None
    elif type_name == "Q5_0":
        d, qh, qs = _half(b[..., 0:2]), b[..., 2:6].copy().view(np.uint32)[..., 0], b[..., 6:22]
        high = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
        q = _nibbles16(qs) + (high.astype(np.int32) << 4) - 16
        scale, mins = d, None
    elif type_name == "Q4_0":
        d = _half(b[..., 0:2])
        q, scale, mins = _nibbles16(b[..., 2:18]), d, -8 * d
    elif type_name == "Q4_1":
        q, scale, mins = _nibbles16(b[..., 4:20]), _half(b[..., 0:2]), _half(b[..., 2:4])
    elif type_name == "Q4_K":
        d, dmin, sc, qs = _half(b[..., 0:2]), _half(b[..., 2:4]), b[..., 4:16].astype(np.int32), b[..., 16:144]
        lo = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)], -1)
        mn = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], -1)
        chunks = qs.reshape(n, k // 256, 4, 32)  # 64 values each: 32 low nibbles, then 32 high
        q = np.stack([chunks & 15, chunks >> 4], 3).reshape(n, k // 256, 8, 32).astype(np.int32)
        scale = d[..., None] * lo.astype(np.float32)
        mins = -(dmin[..., None] * mn.astype(np.float32))
    else:  # Q6_K
        ql, qh = b[..., 0:128].astype(np.int32), b[..., 128:192].astype(np.int32)
        sc, d = b[..., 192:208].copy().view(np.int8).astype(np.float32), _half(b[..., 208:210])
        halves = []
        for h in range(2):  # 128 values per half: ql 64 bytes, qh 32
            l, hb = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
            halves += [(l[..., :32] & 15) | ((hb & 3) << 4), (l[..., 32:] & 15) | (((hb >> 2) & 3) << 4),
                       (l[..., :32] >> 4) | (((hb >> 4) & 3) << 4), (l[..., 32:] >> 4) | (((hb >> 6) & 3) << 4)]
        q = np.concatenate(halves, -1) - 32
        scale, mins = d[..., None] * sc, None
    q = torch.from_numpy(np.ascontiguousarray(q.reshape(n, k)))
    groups = k // (16 if type_name == "Q6_K" else 32)
    scale = torch.from_numpy(np.ascontiguousarray(scale.reshape(n, groups), dtype=np.float32))
    mins = None if mins is None else torch.from_numpy(np.ascontiguousarray(mins.reshape(n, groups), dtype=np.float32))
    return q, scale, mins
