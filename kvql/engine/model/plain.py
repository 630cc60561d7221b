"""A model as transformers runs it: what a baseline beside kvql runs (`kvql bench`)."""

from __future__ import annotations

import copy

from . import cpu_linear, fused_layers


def plain_copy(hf_model):
    """A copy of `hf_model` with kvql's fused modules and linear layers swapped back and SDPA attention; the
    model itself is untouched."""
    plain = copy.deepcopy(hf_model)
    fused_layers.restore(plain)
    cpu_linear.restore(plain)
    plain.set_attn_implementation("sdpa")
    return plain
