"""OpenAI-compatible HTTP server over a local kvql Model."""
