"""Running compiled queries: context, constraints, decoders, results."""
