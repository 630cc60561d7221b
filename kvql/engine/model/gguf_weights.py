"""A GGUF file's tensors as a transformers model's weights: transformers' names and tensor processor for the file's
architecture (Llama's q/k rows permuted, Gemma's norms, MoE experts merged), a tensor dequantized by the `gguf`
package, and the weights a quantized model still lacks filled from the file. The GGUF quantized layers
(quantized.py) and the direct load of a `.gguf` model (kvql.backends.gguf_model) both read through these."""

from __future__ import annotations

import threading

import numpy as np
import torch


def gguf_processor(architecture: str, config):
    """transformers' tensor processor for a GGUF file of `architecture` (its tensors into the model's order and
    names: Llama's q/k rows, Gemma's norms, MoE experts merged)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())


def gguf_names(model: torch.nn.Module, processor) -> dict[str, str]:
    """transformers' map of a GGUF file's tensor names to `model`'s (`get_gguf_hf_weights_map`), its per-module name
    table built once (transformers builds it again for every submodule: seconds for a 30-layer model)."""
    import functools

    import gguf
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    build = gguf.get_tensor_name_map
    with _NAMES:
        gguf.get_tensor_name_map = functools.lru_cache(build)
        try:
            return get_gguf_hf_weights_map(model, processor)
        finally:
            gguf.get_tensor_name_map = build


def dequantized(tensor) -> np.ndarray:
    """A tensor's values in float32, shaped as the file's dimensions reversed (numpy's order)."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    values = gguf.quants.dequantize(tensor.raw, GGMLQuantizationType[tensor.type_name])
    return np.asarray(values, dtype=np.float32).reshape(tuple(reversed(tensor.dims)))


def fill(model, file) -> None:
    """Dequantize from the file every weight still on the meta device (the direct load left it to the blocks and
    `quantized.apply` left its layer dequantized), in the model's dtype."""
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if not missing:
        return
    processor = gguf_processor(file.architecture, model.config)
    to_gguf = {hf: g for g, hf in gguf_names(model, processor).items()}
    for name in missing:
        tensor = file.tensors[to_gguf[name]]
        result = processor.process(weights=dequantized(tensor), name=tensor.name, tensor_key_mapping={},
                                   parsed_parameters={"config": model.config.to_dict(), "tensors": {}})
        module, _, leaf = name.rpartition(".")
        owner = model.get_submodule(module)
        setattr(owner, leaf, torch.nn.Parameter(torch.from_numpy(np.array(result.weights, dtype=np.float32)).to(
            model.dtype), requires_grad=False))


_NAMES = threading.Lock()  # gguf_names swaps a module function of the gguf package for its call
