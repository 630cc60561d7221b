"""`kvql bench --quick` runs end to end on a tiny random model and writes its JSON and PNG."""

from __future__ import annotations

import json
import subprocess
import sys

from kvql.bench import optimal_hit_rate


def test_optimal_hit_rate_counts_tokens_an_earlier_prompt_held():
    assert optimal_hit_rate([[1, 2, 3, 4], [1, 2, 3, 9], [7]]) == 3 / 9
    assert optimal_hit_rate([[1, 2], [1, 2]]) == 1 / 4  # the last token is always computed
    assert optimal_hit_rate([[1, 2], [1, 2, 3, 4]], [[1, 2, 3], [1, 2, 3, 4, 5]]) == 3 / 6  # generated text counts


def test_kvql_bench_quick_writes_json_and_png(tmp_path, llama, tokenizer):
    llama.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = subprocess.run([sys.executable, "-m", "kvql.cli", "bench", "--quick", "--model", str(tmp_path / "model"),
                          "--out", str(tmp_path / "res")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "res" / "bench.json").read_text())
    assert set(data["workloads"]) == {"fewshot", "chat", "tot", "json", "classify"}
    for name, rows in data["workloads"].items():
        assert [r["n"] for r in rows] == [2, 6]
        for r in rows:
            assert r["kvql"] > 0 and r["hf_one_at_a_time"] > 0
            assert 0 <= r["hit_rate"] <= r["optimal_hit_rate"] + 1e-9, (name, r)  # never above what was there
    fewshot = data["workloads"]["fewshot"][-1]
    assert fewshot["hit_rate"] >= 0.8 * fewshot["optimal_hit_rate"] > 0  # kvql finds the shared prefix itself
    assert (tmp_path / "res" / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
