"""LMQL's module path for the state a decorator receives as `context`: kvql's `Context`, under LMQL's name."""

from .context import Context as ProgramState

__all__ = ["ProgramState"]
