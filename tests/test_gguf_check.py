"""A GGUF file's structure is checked before transformers or GGUFReader read it (kvql.backends.gguf_check): every
crafted file fails with one ModelLoadError naming the file, the key or tensor and its byte, never another error."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvql.backends import loader
from kvql.backends.gguf_check import check
from kvql.backends.loader import ModelLoadError

U32, F32, STRING, ARRAY = 4, 6, 8, 9
_FORMATS = {U32: "<I", F32: "<f", 10: "<Q"}
H, FF, VOCAB, LAYERS = 32, 64, 16, 2


def encoded(vtype: int, value) -> bytes:
    if vtype == STRING:
        raw = value.encode() if isinstance(value, str) else value
        return struct.pack("<Q", len(raw)) + raw
    if vtype == ARRAY:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(encoded(etype, v) for v in items)
    return struct.pack(_FORMATS[vtype], value)


def gguf_bytes(keys, tensors, data: bytes, *, version: int = 3, alignment: int = 32) -> bytes:
    """A GGUF file from parts, written byte by byte (what GGUFWriter refuses to write included): `keys` as
    `(key, type, value)`, `tensors` as `(name, dims, type, offset)`."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(keys))
    for key, vtype, value in keys:
        out += encoded(STRING, key) + struct.pack("<I", vtype) + encoded(vtype, value)
    for name, dims, kind, offset in tensors:
        out += encoded(STRING, name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset)
    return out + b"\0" * (-len(out) % alignment) + data


def shapes() -> list[tuple[str, tuple]]:
    """A tiny Llama's tensors, GGUF's dimension order (row length first)."""
    out = [("token_embd.weight", (H, VOCAB))]
    for i in range(LAYERS):
        out += [(f"blk.{i}.attn_norm.weight", (H,)), (f"blk.{i}.attn_q.weight", (H, H)),
                (f"blk.{i}.attn_k.weight", (H, H // 2)), (f"blk.{i}.attn_v.weight", (H, H // 2)),
                (f"blk.{i}.attn_output.weight", (H, H)), (f"blk.{i}.ffn_norm.weight", (H,)),
                (f"blk.{i}.ffn_gate.weight", (H, FF)), (f"blk.{i}.ffn_up.weight", (H, FF)),
                (f"blk.{i}.ffn_down.weight", (FF, H))]
    return out + [("output_norm.weight", (H,))]


def parts(**changed):
    """`(keys, tensors, data)` of a valid tiny Llama file in float32, tensors back to back; `changed` replaces
    keys by name (`llama_block_count=...` for `llama.block_count`)."""
    keys = [("general.architecture", STRING, "llama"), ("llama.block_count", U32, LAYERS),
            ("llama.embedding_length", U32, H), ("llama.feed_forward_length", U32, FF),
            ("llama.context_length", U32, 2048), ("llama.attention.head_count", U32, 4),
            ("llama.attention.head_count_kv", U32, 2), ("tokenizer.ggml.model", STRING, "gpt2"),
            ("tokenizer.ggml.tokens", ARRAY, (STRING, [f"t{i}" for i in range(VOCAB)]))]
    keys = [(k, t, changed.get(k.replace(".", "_"), v)) for k, t, v in keys]
    tensors, offset = [], 0
    for name, dims in shapes():
        tensors.append((name, dims, 0, offset))
        offset += 4 * int(np.prod(dims))
    return keys, tensors, b"\0" * offset


def write(tmp_path: Path, content: bytes, name: str = "x.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


def refused(path: Path, *fragments: str) -> str:
    with pytest.raises(ModelLoadError) as err:
        check(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and " at byte " in message and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_file_written_by_the_gguf_package_passes(tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS), w.add_embedding_length(H), w.add_feed_forward_length(FF)
    w.add_context_length(2048), w.add_head_count(4), w.add_head_count_kv(2)
    w.add_tokenizer_model("gpt2"), w.add_token_list([f"t{i}" for i in range(VOCAB)])
    for name, dims in shapes():
        w.add_tensor(name, np.zeros(dims[::-1], dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    layout = check(path)
    assert (layout.architecture, layout.block_count, layout.tensors) == ("llama", LAYERS, len(shapes()))
    assert layout.data_start % layout.alignment == 0


def test_the_byte_built_file_passes(tmp_path):
    assert check(write(tmp_path, gguf_bytes(*parts()))).version == 3


def test_the_built_in_models_files_pass(tmp_path):
    for name in loader.BUILTIN:
        layout = check(loader.builtin_gguf(name, tmp_path))
        assert layout.block_count >= 1 and layout.tensors > 100


@pytest.mark.parametrize("length, fragment", [(0, "header at byte 0"), (20, "metadata key count at byte 16"),
                                              (23, "metadata key count at byte 16")])
def test_a_file_truncated_in_its_header_is_refused(tmp_path, length, fragment):
    refused(write(tmp_path, gguf_bytes(*parts())[:length]), fragment, "truncated")


def test_a_file_truncated_in_its_metadata_is_refused(tmp_path):
    content = gguf_bytes(*parts())
    cut = content.index(b"t7")  # inside the vocabulary
    refused(write(tmp_path, content[:cut]), "key 'tokenizer.ggml.tokens'", "truncated")


def test_a_file_truncated_in_its_tensor_infos_is_refused(tmp_path):
    content = gguf_bytes(*parts())
    cut = content.index(b"blk.1.attn_q.weight") + 25  # inside its dimensions
    refused(write(tmp_path, content[:cut]), "tensor 'blk.1.attn_q.weight'", "truncated")


def test_a_tensor_of_four_billion_dimensions_is_refused(tmp_path):
    keys, tensors, data = parts()
    content = gguf_bytes(keys, tensors, data)
    at = content.index(b"blk.0.attn_q.weight") + len("blk.0.attn_q.weight")
    content = content[:at] + struct.pack("<I", 2**32 - 1) + content[at + 4:]
    refused(write(tmp_path, content), "tensor 'blk.0.attn_q.weight'", "4,294,967,295 dimensions")


@pytest.mark.parametrize("etype", [U32, STRING, ARRAY])
def test_a_billion_element_array_in_a_small_file_is_refused_before_anything_is_allocated(tmp_path, etype):
    keys, tensors, data = parts()
    content = gguf_bytes(keys + [("general.tags", ARRAY, (etype, []))], tensors, data)
    at = content.index(b"general.tags") + len("general.tags") + 8  # its type, the element type, then the count
    content = content[:at] + struct.pack("<Q", 10**9) + content[at + 8:]
    refused(write(tmp_path, content), "key 'general.tags'", "1,000,000,000")


def test_a_duplicate_key_is_refused(tmp_path):
    keys, tensors, data = parts()
    refused(write(tmp_path, gguf_bytes(keys + [("llama.block_count", U32, 1)], tensors, data)),
            "key 'llama.block_count'", "a second value")


def test_a_duplicate_tensor_name_is_refused(tmp_path):
    keys, tensors, data = parts()
    tensors[2] = (tensors[1][0], *tensors[2][1:])
    refused(write(tmp_path, gguf_bytes(keys, tensors, data)), f"tensor {tensors[1][0]!r}", "a second tensor")


def test_a_tensor_overlapping_another_is_refused(tmp_path):
    keys, tensors, data = parts()
    name, dims, kind, _ = tensors[3]
    tensors[3] = (name, dims, kind, tensors[2][3] + 32)  # inside the tensor before it
    message = refused(write(tmp_path, gguf_bytes(keys, tensors, data)), f"tensor '{name}'", "overlaps tensor")
    assert f"offset {tensors[2][3] + 32} " in message


def test_an_offset_wrapping_to_the_header_is_refused(tmp_path):
    keys, tensors, data = parts()
    start = len(gguf_bytes(keys, tensors, b""))
    name, dims, kind, _ = tensors[0]
    tensors[0] = (name, dims, kind, 2**64 - start)  # data start + offset wraps to byte 0 in 64 bits
    refused(write(tmp_path, gguf_bytes(keys, tensors, data)), "tensor 'token_embd.weight'", "past the file's end",
            f"offset {2**64 - start}")


def test_a_misaligned_offset_is_refused(tmp_path):
    keys, tensors, data = parts()
    name, dims, kind, offset = tensors[-1]
    tensors[-1] = (name, dims, kind, offset + 4)
    refused(write(tmp_path, gguf_bytes(keys, tensors, data + b"\0" * 32)), f"tensor '{name}'",
            "not a multiple of the alignment 32")


def test_a_tensor_past_the_files_end_is_refused(tmp_path):
    keys, tensors, data = parts()
    refused(write(tmp_path, gguf_bytes(keys, tensors, data[:-4])), "tensor 'output_norm.weight'", "past the file's end")


def test_a_million_layers_over_tensors_for_two_are_refused(tmp_path):
    refused(write(tmp_path, gguf_bytes(*parts(llama_block_count=1_000_000))), "key 'llama.block_count'",
            "1,000,000 layers", "blk.0 to blk.1")


def test_layers_count_only_without_a_gap(tmp_path):
    keys, tensors, data = parts(llama_block_count=6)
    tensors = [(n.replace("blk.1.", "blk.5."), *rest) for n, *rest in tensors]
    refused(write(tmp_path, gguf_bytes(keys, tensors, data)), "key 'llama.block_count'", "blk.0 to blk.0")


def test_model_sizes_are_held_to_the_tensors_present(tmp_path):
    for changed, fragment in [({"llama_embedding_length": 4096}, "key 'llama.embedding_length'"),
                              ({"llama_feed_forward_length": 10**6}, "key 'llama.feed_forward_length'"),
                              ({"llama_attention_head_count": 10**6}, "key 'llama.attention.head_count'"),
                              ({"llama_context_length": 10**9}, "key 'llama.context_length'"),
                              ({"tokenizer_ggml_tokens": (STRING, ["t"] * (VOCAB + 1))}, "17 tokens")]:
        refused(write(tmp_path, gguf_bytes(*parts(**changed))), fragment)


@pytest.mark.parametrize("edit, fragment", [
    (lambda c: b"GGUX" + c[4:], "not a GGUF file"),
    (lambda c: c[:4] + struct.pack("<I", 1) + c[8:], "GGUF version 1"),
    (lambda c: c[:4] + struct.pack(">I", 3) + c[8:], "big-endian"),
    (lambda c: c.replace(b"general.architecture", b"general.architectur\xff"), "not UTF-8"),
])
def test_what_is_no_gguf_file_of_a_known_version_is_refused(tmp_path, edit, fragment):
    refused(write(tmp_path, edit(gguf_bytes(*parts()))), fragment)


def test_unknown_types_blocks_and_alignments_are_refused(tmp_path):
    keys, tensors, data = parts()
    bad_type = [(n, d, 99 if n == "output_norm.weight" else k, o) for n, d, k, o in tensors]
    refused(write(tmp_path, gguf_bytes(keys, bad_type, data)), "unknown tensor type 99")
    q8 = [(n, d, 8 if n == "output_norm.weight" else k, o) for n, d, k, o in tensors]  # Q8_0: 32-value blocks
    q8[-1] = ("output_norm.weight", (H + 8,), 8, q8[-1][3])
    refused(write(tmp_path, gguf_bytes(keys, q8, data)), "not a multiple of Q8_0's 32-value blocks")
    refused(write(tmp_path, gguf_bytes(keys + [("general.alignment", U32, 48)], tensors, data, alignment=48)),
            "key 'general.alignment'", "not a power of two")


def test_a_gguf_spec_is_checked_before_transformers_reads_it(tmp_path):
    import kvql

    path = write(tmp_path, gguf_bytes(*parts())[:20])
    with pytest.raises(ModelLoadError, match="metadata key count at byte 16"):
        loader.resolve(str(path))
    with pytest.raises(ModelLoadError, match="metadata key count at byte 16"):
        kvql.model(str(path), weights="gguf")


def test_the_cli_says_one_line_for_a_crafted_file_and_imports_nothing_heavy(tmp_path):
    path = write(tmp_path, gguf_bytes(*parts())[:20], "t.gguf")
    code = ("import sys\nfrom kvql.cli import main\ntry:\n    main(sys.argv[1:])\nfinally:\n"
            "    print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, "generate", "--model", str(path), "hi"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stdout.strip() == "[]"
    assert "Traceback" not in out.stderr and "loading" not in out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"kvql: error: {path}: ")


def test_a_missing_model_path_fails_before_torch_is_imported_or_loading_is_said(tmp_path):
    code = ("import sys\nfrom kvql.cli import main\ntry:\n    main(sys.argv[1:])\nfinally:\n"
            "    print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    missing = str(tmp_path / "no" / "such" / "model")
    out = subprocess.run([sys.executable, "-c", code, "generate", "--model", missing, "hi"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stdout.strip() == "[]"
    assert out.stderr.count("\n") == 1 and "loading" not in out.stderr and "Traceback" not in out.stderr
    assert missing in out.stderr and "not found" in out.stderr


_VALID = gguf_bytes(*parts())
_HEAD = len(gguf_bytes(*parts()[:2], b""))  # where the data section starts: the bytes worth mutating


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, _HEAD - 1), st.integers(0, 255)), max_size=6),
       length=st.one_of(st.none(), st.integers(0, len(_VALID))))
def test_a_mutated_or_truncated_file_passes_or_is_refused_with_a_model_load_error(tmp_path, edits, length):
    content = bytearray(_VALID)
    for at, byte in edits:
        content[at] = byte
    path = write(tmp_path, bytes(content[:length]))
    try:
        check(path)
    except ModelLoadError as e:
        assert str(e).startswith(f"{path}: ") and "\n" not in str(e)
