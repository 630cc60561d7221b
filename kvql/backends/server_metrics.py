"""A server's counters from its Prometheus `/metrics` text (`RemoteBackend.stats`): kvql's `kvql_*_tokens_total`;
vLLM's `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` and its prefix cache's
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` (tokens; the hit rate is hits per query token);
SGLang's `sglang:prompt_tokens_total`, `sglang:cached_tokens_total` (with `--enable-metrics`), else its
`sglang:cache_hit_rate` gauge."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def counters(text: str, kind: str) -> dict:
    """`prompt_tokens`, `cached_tokens`, `computed_tokens`, `generated_tokens`, `hit_rate` where the server of
    `kind` ("kvql", "vllm", "sglang") counts them (kvql's also `ram_tokens` and `disk_tokens`), and `metrics`: every
    sample by name, summed over labels. ValueError where the text does not parse."""
    metrics: dict[str, float] = {}
    for family in text_string_to_metric_families(text):  # ValueError where they do not parse
        for sample in family.samples:
            metrics[sample.name] = metrics.get(sample.name, 0.0) + float(sample.value)
    prefix = {"kvql": "kvql_", "vllm": "vllm:", "sglang": "sglang:"}.get(kind, "")
    names = {"prompt_tokens": "prompt_tokens_total", "generated_tokens": "generation_tokens_total",
             "cached_tokens": "prefix_cache_hits_total"}
    if kind == "kvql":
        names.update(generated_tokens="generated_tokens_total", cached_tokens="cached_tokens_total",
                     ram_tokens="prompt_tokens_from_ram_total", disk_tokens="prompt_tokens_from_disk_total")
    elif kind == "sglang":
        names.update(cached_tokens="cached_tokens_total")
    out = {k: metrics[prefix + v] for k, v in names.items() if prefix + v in metrics}
    if "prompt_tokens" in out and "cached_tokens" in out:
        out["computed_tokens"] = out["prompt_tokens"] - out["cached_tokens"]
        queries = metrics.get(prefix + "prefix_cache_queries_total", out["prompt_tokens"])
        out["hit_rate"] = out["cached_tokens"] / queries if queries else 0.0
    elif kind == "sglang" and "sglang:cache_hit_rate" in metrics:
        out["hit_rate"] = metrics["sglang:cache_hit_rate"]
    out["metrics"] = metrics
    return out
