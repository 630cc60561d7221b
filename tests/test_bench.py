"""`kvql bench --quick` runs end to end on a tiny random model and writes its JSON and PNG; the figure and the
console table say what was measured."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import torch

from kvql import bench
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


def test_the_figure_tells_the_story(make_model, tmp_path):
    """`kvql.bench.run` on a tiny model, then its Figure: a titled 2x3 grid, ticks at the sizes run, y from
    zero, display names, every kvql point annotated with its speed-up and hit rate."""
    m = make_model(name="tiny-llama")
    results = bench.run(m, sizes=(2, 3), out_dir=tmp_path, progress=False)
    fig = bench.plot(results)
    title = fig.get_suptitle()
    assert "tiny-llama" in title and "cpu" in title and f"{torch.get_num_threads()} threads" in title
    assert re.search(r"20\d\d-\d\d-\d\d", title)
    axes = fig.axes
    assert len(axes) == 6
    assert [a.get_subplotspec().get_geometry()[:2] for a in axes] == [(2, 3)] * 6
    panels = axes[:5]
    assert [a.get_title().split(":")[0] for a in panels] == list(bench.WORKLOADS)
    for ax, w in zip(panels, bench.WORKLOADS):
        assert list(ax.get_xticks()) == [2, 3]
        assert ax.get_ylim()[0] == 0
        assert {line.get_label() for line in ax.get_lines()} == {
            "transformers generate, one at a time", "transformers generate_batch", "kvql"}
        notes = [t.get_text() for t in ax.texts]
        rows = results["workloads"][w]
        assert len(notes) == len(rows)  # one per kvql point
        for note, r in zip(notes, rows):
            assert note == f"{r['kvql_vs_hf_one_at_a_time']:.1f}x\nhit {r['hit_rate']:.0%}"
    summary = axes[5]
    assert summary.get_ylim()[0] == 0 and "speed-up" in summary.get_title()
    assert [t.get_text() for t in summary.get_xticklabels()] == list(bench.WORKLOADS)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "transformers generate, one at a time", "transformers generate_batch", "kvql"]
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_console_table_has_baseline_seconds_speed_up_answers_equal_and_hit_rate(make_model, tmp_path):
    m = make_model()
    results = bench.run(m, workloads=("fewshot", "json"), sizes=(2,), out_dir=tmp_path, progress=False,
                        batch_baseline=False)
    lines = bench.table(results).splitlines()
    header = next(line for line in lines if line.startswith("workload"))
    for column in ("baseline s", "kvql s", "speed-up", "answers equal", "hit rate"):
        assert column in header
    fewshot = next(line for line in lines if line.startswith("fewshot")).split()
    r = results["workloads"]["fewshot"][0]
    assert fewshot[2] == f"{r['seconds']['hf_one_at_a_time']:.2f}"
    assert fewshot[4] == f"{r['kvql_vs_hf_one_at_a_time']:.2f}x"
    assert fewshot[6] == "2/2"  # greedy on both sides, fp32: kvql's answers are the baseline's
    assert fewshot[7] == f"{r['hit_rate']:.2f}"
    assert next(line for line in lines if line.startswith("json")).split()[6] == "n/a"  # constrained on one side
