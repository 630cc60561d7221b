"""The one error type of loading a model: `ModelLoadError`.

Its own module so that what checks a model's files before loading (`gguf_check`) and what loads them (`loader`,
which re-exports it) raise the same type without importing each other.
"""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model spec could not be resolved or loaded; the message names what was tried."""
