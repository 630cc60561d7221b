"""A GGUF file as a model, read directly: `config_and_tokenizer(path, layout)`, then `load(path, layout, config, dtype,
keep_blocks)` -> the model.

transformers' own GGUF loading parses the file's metadata with the `gguf` package's reader four times (every
token string of the vocabulary a numpy view: seconds each) and dequantizes every tensor; kvql's quantized layers
then read the file once more. Here the file is read once, through the checked parse (`gguf_check.check`: every
count, offset and size bounded before it is used), and mapped:
- the config and the tokenizer are transformers' own (its GGUF config mapping and tokenizer converter), given
  kvql's parse of the metadata in place of the `gguf` package's reader (`_Fields`; arrays other than the
  vocabulary's length are not needed for a config);
- the weights: each tensor as its bytes in the mapped file (`kvql.engine.GGUFFile`); with `keep_blocks`
  (weights="gguf") the linear layers whose blocks qgemm runs are left unread (on the meta device) for the engine to take
  straight from the file, the rest dequantized once (the `gguf` package's numpy `dequantize`, then transformers'
  tensor processor: Llama's q/k row order, Gemma's norm offsets) into transformers' `from_pretrained(state_dict=)`.
The engine (`Engine(weights="gguf", gguf=blocks(...))`) then dequantizes what its quantization left on the meta
device (a layer stacked with one of a type qgemm does not run). No step depends on the file's size but the tensors'
own bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from pathlib import Path

import numpy as np

from . import gguf_check

_INT64 = 11
_LOCK = threading.Lock()  # the `gguf` package's reader is swapped for kvql's parse during one load at a time


class _Field:
    """One metadata value as transformers reads a `gguf.ReaderField`: `parts[i]` for `i` in `data`, of `types`."""

    def __init__(self, types: list[int], parts, data):
        self.types, self.parts, self.data = types, parts, data


class _Blank:
    """The elements of a string array transformers only counts (the vocabulary, for a missing vocab_size)."""

    def __getitem__(self, i):
        return np.zeros(0, np.uint8)


class _Fields:
    """What transformers' `load_gguf_checkpoint(return_tensors=False)` reads of a `gguf.GGUFReader`: `fields` and
    `tensors` (their names), from kvql's parse."""

    def __init__(self, layout: gguf_check.Layout):
        self.fields = {}
        for key, f in layout.fields.items():
            value = f.value
            if isinstance(value, str):
                self.fields[key] = _Field([f.type], [np.frombuffer(value.encode(), np.uint8)], [0])
            elif isinstance(value, gguf_check.Array):  # (a namedtuple: before the tuples)
                if key == "tokenizer.ggml.tokens":
                    self.fields[key] = _Field([gguf_check.ARRAY, gguf_check.STRING], _Blank(), range(value.count))
            elif isinstance(value, tuple):  # a short int array (transformers reads every int type alike)
                self.fields[key] = _Field([gguf_check.ARRAY, _INT64], [np.array([v]) for v in value], range(len(value)))
            else:
                self.fields[key] = _Field([f.type], [np.array([value])], [0])
        self.tensors = [_Named(t.name) for t in layout.table]


class _Named:
    def __init__(self, name: str):
        self.name = name


@contextlib.contextmanager
def _reading(path: Path, layout: gguf_check.Layout):
    """Inside: `gguf.GGUFReader(path)` answers with kvql's parse of `path` (other paths: the real reader)."""
    import gguf

    real = gguf.GGUFReader

    def reader(p, *args, **kwargs):
        return _Fields(layout) if Path(p) == path else real(p, *args, **kwargs)

    with _LOCK:
        gguf.GGUFReader = reader
        try:
            yield
        finally:
            gguf.GGUFReader = real


def blocks(path: Path, layout: gguf_check.Layout):
    """The file's tensors as a `GGUFFile` (each a view of the mapped file; nothing read yet)."""
    from ..engine import GGUFFile, GGUFTensor

    with open(path, "rb") as f:  # a plain array over the mapping (numpy's memmap subclass costs per operation)
        data = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
    tensors = {}
    for t in layout.table:
        start = layout.data_start + t.offset
        rows = t.elements // t.dims[0] if t.dims else 1
        raw = data[start:start + t.nbytes].reshape(rows, -1)
        tensors[t.name] = GGUFTensor(t.name, t.kind, tuple(t.dims), raw)
    return GGUFFile(str(path), layout.architecture, tensors)


def config_and_tokenizer(path: Path, layout: gguf_check.Layout):
    """transformers' config and tokenizer for the file, from kvql's parse of its metadata. The tokenizer is
    converted once per metadata (a 262k vocabulary: ~8 s) and kept in kvql's cache directory under the SHA-256 of
    the file's metadata bytes and the transformers version; later loads read that copy."""
    import hashlib
    import shutil
    import tempfile

    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from .loader import cache_dir

    with open(path, "rb") as f:
        key = hashlib.sha256(f.read(layout.data_start) + transformers.__version__.encode()).hexdigest()[:20]
    saved = cache_dir() / "gguf-tokenizers" / key
    with _reading(path, layout):
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if (saved / "tokenizer_config.json").is_file():
            return config, AutoTokenizer.from_pretrained(saved)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    staging = None
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=saved.parent, prefix=f".{key}-"))
        tokenizer.save_pretrained(staging)
        staging.rename(saved)  # atomic: a concurrent load reads all files or none
    except OSError:  # a read-only cache, or another process saved it first: converted again next time
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return config, tokenizer


def load(path: Path, layout: gguf_check.Layout, config, dtype, keep_blocks: bool):
    """The model of the checked GGUF file at `path` (module doc), `config` its `config_and_tokenizer`'s."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from ..engine import GGUF_BLOCK_TYPES, dequantized_gguf, gguf_names, gguf_processor, qgemm_fits

    file = blocks(path, layout)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    processor = gguf_processor(layout.architecture, config)
    names = gguf_names(skeleton, processor)
    linears = {f"{n}.weight": m for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear)}
    parsed = {"config": config.to_dict(), "tensors": {}}
    state, kept = {}, set()
    tied = config.get_text_config().tie_word_embeddings and "output.weight" not in file.tensors
    for name, tensor in file.tensors.items():
        hf = names.get(name)
        linear = linears.get(hf)
        if tied and linear is None and name == "token_embd.weight":  # the head's blocks too
            linear = skeleton.get_output_embeddings()
        if (keep_blocks and linear is not None and tensor.type_name in GGUF_BLOCK_TYPES
                and qgemm_fits(linear.out_features, linear.in_features)):
            kept.add(hf)  # the engine's quantization takes its blocks
            continue
        result = processor.process(weights=dequantized_gguf(tensor), name=name, tensor_key_mapping=names,
                                   parsed_parameters=parsed)
        if result.name in names:
            state[names[result.name]] = torch.from_numpy(np.array(result.weights, dtype=np.float32)).to(dtype)
    state.update({k: v.to(dtype) for k, v in parsed["tensors"].items()})
    # the kept weights as uninitialized memory (pages never touched): from_pretrained would draw them at random
    shapes = dict(skeleton.named_parameters(remove_duplicate=False))
    state.update({hf: torch.empty(shapes[hf].shape, dtype=dtype) for hf in kept if hf in shapes and hf not in state})
    model_class = type(skeleton)
    del skeleton
    was = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its report lists the weights left to the blocks as missing
    try:
        model = model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype)
    finally:
        hf_logging.set_verbosity(was)
    model.config._name_or_path = str(path.parent)  # as transformers names a model loaded from a GGUF file
    _unload(model, kept)
    return model.eval()


def _unload(model, names: set[str]) -> None:
    """Put the weights `names` (left to the file's blocks) on the meta device, a tied weight's every name alike:
    nothing may read them before the engine's quantization replaces their layers (or fills them from the file)."""
    import torch

    owners = [(name.rpartition("."), p) for name, p in model.named_parameters(remove_duplicate=False)]
    chosen = {id(p) for (module, _, leaf), p in owners if f"{module}.{leaf}".lstrip(".") in names}
    empty = {}
    for (module, _, leaf), p in owners:
        if id(p) in chosen:
            meta = empty.setdefault(id(p), torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False))
            setattr(model.get_submodule(module), leaf, meta)
