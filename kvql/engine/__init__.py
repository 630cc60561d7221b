"""The engine: radix KV cache, KV pool, scheduler, model runner, sampler."""
