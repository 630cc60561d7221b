"""Validate a GGUF file's structure before anything else reads it: `check(path) -> Layout`.

transformers (through the `gguf` package's GGUFReader) and kvql's quantized layers trust a GGUF file's counts,
lengths and offsets: a crafted file makes them read another tensor's bytes or the header as weights, allocate a
million layers, or fail with a raw `struct.error`. `check` parses the header, every metadata key/value and every
tensor info with reads bounded by the bytes that remain, as llama.cpp's `gguf_init_from_file` does, then holds
the sizes the metadata gives the model to the tensors present. It never reads tensor data; its time and memory
are bounded by the caps below, not by the counts a file claims.

A file that passes has (each failure: a `ModelLoadError` naming the file, the key or tensor, and its byte):
- magic `GGUF`, version 2 or 3, little-endian; every count and length fits in the bytes that remain, checked
  before anything is allocated or looped over, within `MAX_KEYS`, `MAX_TENSORS`, `MAX_STRING`, `MAX_ITEMS`;
  keys, tensor names (< 64 bytes, as GGML_MAX_NAME) and strings in UTF-8; no key or tensor name twice; arrays
  nested at most `MAX_DEPTH` deep.
- `general.alignment` (uint32, default 32) a power of two; the data section starts where the tensor infos end,
  rounded up to it.
- each tensor: at most 4 dims (GGML_MAX_DIMS), each >= 1; a type the `gguf` package knows; its row length a
  multiple of that type's block; its offset aligned; its bytes inside the data section, overlapping no other's.
- the model: `general.architecture` a string; `{arch}.block_count` from 1 to the layers present (`blk.0.` on
  without a gap); `{arch}.embedding_length` (H) the row length of `token_embd.weight`; the vocabulary (the
  `tokenizer.ggml.tokens` array, `{arch}.vocab_size`) no longer than that table; the sizes transformers allocates
  weights from (`_WIDTHS`) no larger than weights the file holds: per layer at least an H x size matrix;
  `{arch}.context_length` at most `max(2**16, elements / H)` (position tables are allocated from it).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import re
import struct
from pathlib import Path

from .gguf_cursor import MAX_ITEMS, MAX_STRING, Cursor, fail
from .load_error import ModelLoadError

MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 63  # GGML_MAX_NAME is 64 bytes with the terminating NUL
MAX_KEYS = 1 << 16  # real files have ~50
MAX_TENSORS = 1 << 16  # DeepSeek V3's file has ~1,100
MAX_DEPTH = 2  # an array of arrays at most (llama.cpp reads none)
MAX_CONTEXT = 1 << 24
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_INTS = {0, 1, 2, 3, 4, 5, 10, 11}
_LAYER = re.compile(r"blk\.(\d+)\.")
# {arch}.KEY sizes transformers builds weight matrices from: each needs an H x size matrix per layer in the file
_WIDTHS = ("feed_forward_length", "expert_feed_forward_length", "expert_shared_feed_forward_length",
           "attention.key_length", "attention.value_length", "rope.dimension_count", "expert_count",
           "attention.q_lora_rank", "attention.kv_lora_rank", "ssm.inner_size", "ssm.state_size")


@dataclasses.dataclass(frozen=True)
class Layout:
    """What `check` read: enough to say what the file is, nothing of its tensor data."""

    version: int
    alignment: int
    data_start: int
    architecture: str
    block_count: int
    tensors: int
    keys: int
    fields: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """key -> `_Field(key, at, type, value)`: scalars and strings as read, short int arrays as tuples, other
    arrays as `Array(type, count)`."""
    table: tuple = dataclasses.field(default=(), repr=False, compare=False)
    """The tensor infos, `_Tensor(name, at, dims, elements, nbytes, offset, kind)`, offsets from `data_start`."""


Array = collections.namedtuple("Array", "type count")  # an array value not kept: its element type and length
# a key's value: a scalar, a str, a tuple of ints (a short int array), else an Array
_Field = collections.namedtuple("_Field", "key at type value")
_Tensor = collections.namedtuple("_Tensor", "name at dims elements nbytes offset kind")


def check(path: str | Path) -> Layout:
    """The layout of the GGUF file at `path` once its structure is known sound (module doc); else a
    `ModelLoadError` naming the file, the field or tensor, and its byte offset. Reads only the header, the
    metadata and the tensor infos. A file that passed before is not parsed again while its size and the bytes
    before its data are those it passed with (everything the checks read: one load checks its file three times,
    the spec, the loader and the quantized layers, and parsing a 262k vocabulary takes ~0.4 s)."""
    name = str(path)
    seen = _PASSED.get(name)
    if seen is not None:
        size, digest, layout = seen
        try:
            with open(name, "rb") as f:
                if os.fstat(f.fileno()).st_size == size and hashlib.sha256(f.read(layout.data_start)).digest() == digest:
                    return layout
        except OSError:
            pass
    layout = _parse(name)
    with open(name, "rb") as f:
        record = (os.fstat(f.fileno()).st_size, hashlib.sha256(f.read(layout.data_start)).digest(), layout)
    if len(_PASSED) >= 8:
        _PASSED.pop(next(iter(_PASSED)), None)
    _PASSED[name] = record
    return layout


_PASSED: dict[str, tuple] = {}  # file -> (size, SHA-256 of the bytes before its data, Layout): `check`'s memory


def _parse(name: str) -> Layout:
    try:
        with open(name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            cur = Cursor(f, size, name)
            version, n_tensors, n_keys = _header(cur)
            fields = _metadata(cur, n_keys)
            tensors = _tensor_infos(cur, n_tensors)
    except OSError as e:
        raise ModelLoadError(f"{name}: cannot be read: {e.strerror or e}") from None
    alignment = _alignment(name, fields)
    data_start = -(-cur.pos // alignment) * alignment
    _place(name, tensors, data_start, alignment, size)
    architecture, block_count = _model(name, fields, tensors, metadata_at=24)
    return Layout(version, alignment, data_start, architecture, block_count, len(tensors), len(fields), fields,
                  tuple(tensors))


def _header(cur: Cursor) -> tuple[int, int, int]:
    magic = cur.take(4)
    if magic != b"GGUF":
        cur.fail(f"not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    version = cur.u32()
    if version & 0xFFFF == 0:
        cur.fail(f"version {version:#x}: a big-endian file (kvql reads little-endian GGUF files)")
    if version not in (2, 3):
        cur.fail(f"GGUF version {version}: kvql reads versions 2 and 3" + (" (version 1 is obsolete)" if version == 1
                                                                           else ""))
    cur.begin("tensor count")
    n_tensors = cur.u64()
    if n_tensors > MAX_TENSORS:
        cur.fail(f"{n_tensors:,} tensors: at most {MAX_TENSORS:,}")
    cur.begin("metadata key count")
    n_keys = cur.u64()
    if n_keys > MAX_KEYS:
        cur.fail(f"{n_keys:,} metadata keys: at most {MAX_KEYS:,}")
    return version, n_tensors, n_keys


def _metadata(cur: Cursor, n_keys: int) -> dict[str, _Field]:
    fields: dict[str, _Field] = {}
    for i in range(n_keys):
        cur.begin(f"metadata key #{i}")
        key = cur.string(MAX_STRING, "key")
        if not key:
            cur.fail("an empty key")
        cur.where = f"key {key!r}"
        if key in fields:
            cur.fail(f"a second value for key {key!r} (the first at byte {fields[key].at})")
        vtype = cur.u32()
        fields[key] = _Field(key, cur.at, vtype, _value(cur, vtype, 0))
    return fields


def _value(cur: Cursor, vtype: int, depth: int):
    """One value of type `vtype`: arrays of strings or of arrays are checked and skipped, arrays of fixed-size
    values skipped unread but for short integer arrays (per-layer sizes, kept for `_model`)."""
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, cur.take(struct.calcsize(fmt)))[0]
    if vtype == STRING:
        return cur.string()
    if vtype != ARRAY:
        cur.fail(f"unknown value type {vtype}")
    if depth >= MAX_DEPTH:
        cur.fail(f"arrays nested more than {MAX_DEPTH} deep")
    etype, count = cur.u32(), cur.u64()
    if etype in _SCALARS:
        fmt = _SCALARS[etype]
        cur.bound(count, struct.calcsize(fmt), "array length")
        nbytes = count * struct.calcsize(fmt)
        if etype in _INTS and count <= 4096:
            return struct.unpack(f"<{count}{fmt[1]}", cur.take(nbytes))
        cur.skip(nbytes)
    elif etype == STRING:
        cur.bound(count, 8, "array length")
        cur.spend(count)
        cur.strings(count)
    elif etype == ARRAY:
        cur.bound(count, 12, "array length")
        cur.spend(count)
        for _ in range(count):
            _value(cur, ARRAY, depth + 1)
    else:
        cur.fail(f"array of unknown value type {etype}")
    return Array(etype, count)


def _tensor_infos(cur: Cursor, n_tensors: int) -> list[_Tensor]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors, seen = [], {}
    for i in range(n_tensors):
        cur.begin(f"tensor #{i}")
        name = cur.string(MAX_NAME, "tensor name")
        cur.where = f"tensor {name!r}"
        if name in seen:
            cur.fail(f"a second tensor named {name!r} (the first at byte {seen[name]})")
        seen[name] = cur.at
        n_dims = cur.u32()
        if n_dims > MAX_DIMS:
            cur.fail(f"{n_dims:,} dimensions: at most {MAX_DIMS} (GGML_MAX_DIMS)")
        dims = tuple(cur.u64() for _ in range(n_dims))
        if any(d < 1 for d in dims):
            cur.fail(f"dimensions {list(dims)}: each must be at least 1")
        kind = cur.u32()
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            cur.fail(f"unknown tensor type {kind}")
        row = dims[0] if dims else 1
        if row % block:
            cur.fail(f"rows of {row:,} values: not a multiple of {GGMLQuantizationType(kind).name}'s "
                     f"{block}-value blocks")
        elements = 1
        for d in dims:
            elements *= d
        nbytes = elements // block * type_size
        offset = cur.u64()
        tensors.append(_Tensor(name, cur.at, dims, elements, nbytes, offset, GGMLQuantizationType(kind).name))
    return tensors


def _alignment(name: str, fields: dict[str, _Field]) -> int:
    field = fields.get("general.alignment")
    if field is None:
        return DEFAULT_ALIGNMENT
    where = "key 'general.alignment'"
    if field.type != 4:
        fail(name, where, field.at, "must be a uint32")
    if field.value < 1 or field.value & (field.value - 1):
        fail(name, where, field.at, f"{field.value:,} is not a power of two")
    return field.value


def _place(name: str, tensors: list[_Tensor], data_start: int, alignment: int, size: int) -> None:
    """Each tensor's bytes aligned, inside the data section, overlapping no other tensor's."""
    data_size = size - data_start
    for t in tensors:
        where = f"tensor {t.name!r}"
        if t.offset % alignment:
            fail(name, where, t.at, f"offset {t.offset} is not a multiple of the alignment {alignment}")
        if t.offset + t.nbytes > data_size:
            fail(name, where, t.at, f"offset {t.offset} + {t.nbytes:,} bytes ends past the file's end (its data "
                                    f"section: {max(data_size, 0):,} bytes from byte {data_start})")
    ordered = sorted(tensors, key=lambda t: t.offset)
    for before, t in zip(ordered, ordered[1:]):
        if t.offset < before.offset + before.nbytes:
            fail(name, f"tensor {t.name!r}", t.at, f"offset {t.offset} overlaps tensor {before.name!r} (offsets "
                                                   f"{before.offset} to {before.offset + before.nbytes})")


def _model(name: str, fields: dict[str, _Field], tensors: list[_Tensor], metadata_at: int) -> tuple[str, int]:
    """`(architecture, block_count)`, once the sizes the metadata gives the model are held to its tensors."""
    arch = fields.get("general.architecture")
    if arch is None or arch.type != STRING or not arch.value:
        fail(name, "metadata", metadata_at, "no general.architecture string: not a model file")
    a = arch.value

    def size(key: str, required: bool = False) -> int | None:
        field = fields.get(f"{a}.{key}")
        if field is None:
            if required:  # transformers would take its config class's default (Llama: 32 layers of 4,096)
                fail(name, "metadata", metadata_at, f"no key '{a}.{key}'")
            return None
        values = field.value if isinstance(field.value, tuple) else (field.value,)
        if field.type not in _INTS and not (field.type == ARRAY and isinstance(field.value, tuple)):
            fail(name, f"key '{a}.{key}'", field.at, "must be an integer (or a short array of integers)")
        if not values or min(values) < 0:
            fail(name, f"key '{a}.{key}'", field.at, f"{list(values)} is no size")
        return max(values)

    def too_big(key: str, problem: str):
        fail(name, f"key '{a}.{key}'", fields[f"{a}.{key}"].at, problem)

    present = {int(m.group(1)) for t in tensors if (m := _LAYER.match(t.name))}
    layers = 0
    while layers in present:
        layers += 1
    blocks = size("block_count", required=True)
    if not 1 <= blocks <= layers:
        too_big("block_count", f"{blocks:,} layers, but the file holds tensors for {layers} (blk.0 to blk.{layers - 1})"
                if layers else f"{blocks:,} layers, but the file holds no blk.N tensors")
    hidden = size("embedding_length", required=True)
    elements = sum(t.elements for t in tensors)
    embed = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if hidden < 1 or (embed is not None and embed.dims[:1] != (hidden,)):
        too_big("embedding_length", f"{hidden:,}, but token_embd.weight's dimensions are {list(embed.dims)}"
                if embed is not None else f"{hidden:,} is no size")
    if blocks * hidden * hidden > elements:
        too_big("embedding_length", f"{blocks:,} layers of width {hidden:,} need more weights than the file's "
                                    f"{elements:,} values")
    _widths(size, too_big, blocks * hidden, elements)
    _vocabulary(name, fields, a, embed, hidden, elements)
    context = size("context_length")
    if context is not None and not 1 <= context <= min(MAX_CONTEXT, max(1 << 16, elements // hidden)):
        too_big("context_length", f"{context:,} positions: more than this model's weights can back")
    return a, blocks


def _widths(size, too_big, per_value: int, elements: int) -> None:
    """Each size transformers builds matrices from needs, per layer, an H x size matrix the file holds."""
    for key in _WIDTHS:
        width = size(key)
        if width is not None and width * per_value > elements:
            too_big(key, f"{width:,}: matrices of that size need more weights than the file's {elements:,} values")
    heads = size("attention.head_count")
    if heads:
        head_dim = max(size("attention.key_length") or 0, size("rope.dimension_count") or 0, 1)
        if heads * head_dim * per_value > elements:
            too_big("attention.head_count", f"{heads:,} heads of {head_dim:,} need more weights than the file's "
                                            f"{elements:,} values")


def _vocabulary(name: str, fields: dict[str, _Field], a: str, embed: _Tensor | None, hidden: int,
                elements: int) -> None:
    """The vocabulary is no longer than the embedding table the file holds (transformers allocates it)."""
    rows = embed.dims[1] if embed is not None and len(embed.dims) > 1 else elements // hidden
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        if not (isinstance(tokens.value, Array) and tokens.value.type == STRING):
            fail(name, "key 'tokenizer.ggml.tokens'", tokens.at, "must be an array of strings")
        if tokens.value.count > rows:
            fail(name, "key 'tokenizer.ggml.tokens'", tokens.at, f"{tokens.value.count:,} tokens, but the embedding "
                                                                 f"table has {rows:,} rows")
    declared = fields.get(f"{a}.vocab_size")
    if declared is not None and not (declared.type in _INTS and 1 <= declared.value <= rows):
        fail(name, f"key '{a}.vocab_size'", declared.at, f"{declared.value!r} tokens: the embedding table has "
                                                         f"{rows:,} rows")
