"""Model handles: the local engine backend and the model loader."""
