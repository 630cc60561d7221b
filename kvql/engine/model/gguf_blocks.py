"""GGUF's quantized blocks as `qgemm`'s integers and per-group scales, without rounding anything.

`decode(type_name, raw, k)`: `raw` a tensor's bytes as the file holds them (`[n, bytes per row]` uint8, one row per
output), `k` its inputs; returns `(q [n, k], scale [n, k / group], min [n, k / group] or None)` (torch: q int8 or
uint8, scale and min float32) with `scale * q + min` equal to the weight llama.cpp's dequantization gives, bit for
bit in float32 (tests/test_quantized.py checks it against the `gguf` package's), or None for a type it does not
take. Each type on the fewest of qgemm's bits that hold it (8; 5 or 4 with a minimum):
- Q8_0: 32 int8 and a float16 d; w = d q: 8-bit, groups of 32.
- Q5_0: 32 5-bit q and d; w = d (q - 16): 5-bit, min -16 d.   Q5_1: w = d q + m: 5-bit, min m.
- Q4_0: 32 4-bit q and d; w = d (q - 8): 4-bit, min -8 d.     Q4_1: w = d q + m: 4-bit, min m.
- Q5_K / Q4_K: 256 per super-block: float16 d and dmin, 8 sub-blocks of 32 with 6-bit scale sc and min mn;
  w = d sc q - dmin mn: 5- / 4-bit, scale d sc, min -dmin mn (each product exact in float32).
- Q6_K: 256 per super-block: 16 sub-blocks of 16 with an int8 scale, float16 d; w = d sc (q - 32): 8-bit values
  q - 32, groups of 16.
- Q3_K: 16 sub-blocks of 16, 6-bit scales sc, 3-bit q3 in [-4, 3]; w = d (sc - 32) q3: 4-bit values q3 + 4,
  groups of 16, min -4 d (sc - 32) (4 bits where the file has 3.4).
- Q2_K: 16 sub-blocks of 16, 4-bit scale and min each; w = d sc q - dmin mn: 4-bit (the file: 2.6), groups of 16.
- IQ4_NL / IQ4_XS: 4-bit codes into llama.cpp's 16 non-linear int8 values, per 32 a float16 d (IQ4_XS: d times a
  6-bit sub-block scale minus 32); w = d table[code]: 8-bit values table[code] (the file: 4.5).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q5_K", "Q4_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS")
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
"""llama.cpp's `kvalues_iq4nl`: the values IQ4_NL's and IQ4_XS's codes stand for."""
BITS = {"Q8_0": 8, "Q6_K": 8, "IQ4_NL": 8, "IQ4_XS": 8, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q4_0": 4, "Q4_1": 4,
        "Q4_K": 4, "Q3_K": 4, "Q2_K": 4}
"""The qgemm bits each type is held in (`QWeight.pack(..., bits=)`): the same for every tensor of a type."""
SUPER = ("Q5_K", "Q4_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS")
"""Types in 256-value super-blocks (the others: blocks of 32)."""


@dataclass(frozen=True)
class Tensor:
    """One tensor of a GGUF file: its GGML type's name, its dimensions as the file lists them (row length first)
    and its bytes (`raw`: a read-only view of the mapped file, `[rows, bytes per row]`)."""
    name: str
    type_name: str
    dims: tuple[int, ...]
    raw: np.ndarray


@dataclass(frozen=True)
class File:
    """A GGUF file's tensors by name, its structure already checked (kvql.backends.gguf_check)."""
    path: str
    architecture: str
    tensors: dict[str, Tensor]


def _half(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 pairs of bytes (last axis 2) as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles16(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: low nibbles are values 0..15, high nibbles 16..31 (Q4_0, Q4_1, Q5_x, IQ4)."""
    return np.concatenate([qs & 15, qs >> 4], -1)


def _bits(words: np.ndarray, count: int) -> np.ndarray:
    """Bits 0 .. count - 1 of little-endian uint32 words (last axis 4 bytes) as 0 / 1 uint8, bit i at index i."""
    w = np.ascontiguousarray(words).view(np.uint32)[..., 0]
    return ((w[..., None] >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (llama.cpp's get_scale_min_k4)."""
    sc = sc.astype(np.int32)
    scale = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)], -1)
    mins = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], -1)
    return scale, mins


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K's 64 bytes of 2-bit values -> 256, in the order llama.cpp dequantizes them: per half of 128,
    shift 0, 2, 4, 6, each over bytes 0..15 then 16..31 of the half's 32."""
    halves = qs.reshape(*qs.shape[:-1], 2, 1, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
    return ((halves >> shifts) & 3).reshape(*qs.shape[:-1], 256)


def _q8_0(b, n, k):
    return b[..., 2:34].copy().view(np.int8), _half(b[..., 0:2]), None


def _q5(b, n, k, legacy_min: bool):
    d, start = _half(b[..., 0:2]), 2 if legacy_min else 4
    q = _nibbles16(b[..., start + 4:start + 20]) | (_bits(b[..., start:start + 4], 32) << 4)
    return q, d, (-16 * d if legacy_min else _half(b[..., 2:4]))


def _q4_0(b, n, k):
    d = _half(b[..., 0:2])
    return _nibbles16(b[..., 2:18]), d, -8 * d


def _q4_1(b, n, k):
    return _nibbles16(b[..., 4:20]), _half(b[..., 0:2]), _half(b[..., 2:4])


def _q45_k(b, n, k, five: bool):
    d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    qs = b[..., 48:176] if five else b[..., 16:144]
    chunks = qs.reshape(n, k // 256, 4, 32)  # 64 values each: 32 low nibbles, then 32 high
    q = np.stack([chunks & 15, chunks >> 4], 3)  # [n, blocks, 4, 2, 32]
    if five:  # value l of chunk c's low / high half: bit 2 c / 2 c + 1 of qh[l]
        high = (b[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [n, blocks, 32, 8]
        q = q | (high.transpose(0, 1, 3, 2).reshape(n, k // 256, 4, 2, 32) << 4)
    return q, d[..., None] * sc.astype(np.float32), -(dmin[..., None] * mn.astype(np.float32))


def _q6_k(b, n, k):
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc, d = b[..., 192:208].copy().view(np.int8).astype(np.float32), _half(b[..., 208:210])
    halves = []
    for h in range(2):  # 128 values per half: ql 64 bytes, qh 32
        l, hb = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        halves += [(l[..., :32] & 15) | ((hb & 3) << 4), (l[..., 32:] & 15) | (((hb >> 2) & 3) << 4),
                   (l[..., :32] >> 4) | (((hb >> 4) & 3) << 4), (l[..., 32:] >> 4) | (((hb >> 6) & 3) << 4)]
    return (np.concatenate(halves, -1).astype(np.int16) - 32).astype(np.int8), d[..., None] * sc, None


def _q3_k(b, n, k):
    hmask, qs, s, d = b[..., 0:32], b[..., 32:96], b[..., 96:108].astype(np.int32), _half(b[..., 108:110])
    j = np.arange(16)
    low = np.where(j < 8, s[..., j % 8] & 15, s[..., j % 8] >> 4)
    sc = low | (((s[..., 8 + j % 4] >> (2 * (j // 4))) & 3) << 4)
    # hmask bit 4 h + shift of byte l (of 32) goes with the value at half h, shift, byte l
    high = ((hmask[..., None, None, :] >> (4 * np.arange(2).reshape(2, 1, 1) + np.arange(4).reshape(1, 4, 1)))
            & 1).reshape(n, k // 256, 256)
    scale = d[..., None] * (sc - 32).astype(np.float32)
    return _crumbs(qs) + 4 * high, scale, -4 * scale  # q3 + 4: in [0, 7]


def _q2_k(b, n, k):
    s, qs, d, dmin = b[..., 0:16], b[..., 16:80], _half(b[..., 80:82]), _half(b[..., 82:84])
    return _crumbs(qs), d[..., None] * (s & 15).astype(np.float32), -(dmin[..., None] * (s >> 4).astype(np.float32))


def _iq4_nl(b, n, k):
    return IQ4_VALUES[_nibbles16(b[..., 2:18])], _half(b[..., 0:2]), None


def _iq4_xs(b, n, k):
    d, high, low = _half(b[..., 0:2]), b[..., 2:4].copy().view(np.uint16)[..., 0], b[..., 4:8]
    sub = np.arange(8)
    ls = ((low[..., sub // 2] >> (4 * (sub % 2))) & 15) | (((high[..., None] >> (2 * sub)) & 3) << 4)
    q = IQ4_VALUES[_nibbles16(b[..., 8:136].reshape(n, k // 256, 8, 16))]
    return q, d[..., None] * (ls.astype(np.int32) - 32).astype(np.float32), None


_DECODERS = {"Q8_0": _q8_0, "Q5_0": functools.partial(_q5, legacy_min=True),
             "Q5_1": functools.partial(_q5, legacy_min=False), "Q4_0": _q4_0, "Q4_1": _q4_1,
             "Q4_K": functools.partial(_q45_k, five=False), "Q5_K": functools.partial(_q45_k, five=True),
             "Q6_K": _q6_k, "Q3_K": _q3_k, "Q2_K": _q2_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}


def decode(type_name: str, raw: np.ndarray, k: int):
    """(q, scale, min or None) of a tensor of `type_name` (module doc), None for a type not in `TYPES`."""
    if type_name not in TYPES:
        return None
    n = raw.shape[0]
    q, scale, mins = _DECODERS[type_name](raw.reshape(n, k // (256 if type_name in SUPER else 32), -1), n, k)

    def tensor(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype).reshape(n, -1))

    q = tensor(q, np.int8 if q.dtype == np.int8 else np.uint8)
    return q, tensor(scale, np.float32), None if mins is None else tensor(mins, np.float32)
