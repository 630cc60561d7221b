"""`kvql bench --quick` runs end to end on a tiny random model and writes its JSON and PNG; the figure and the
console table say what was measured; repeats give the best and the median time; a busy machine or a wide
spread of repeats is flagged in the table and on the figure (measured noise is injected here: no test
depends on how busy this machine is)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from kvql import bench, bench_report
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
    assert data["meta"]["repeats"] == 1 and data["machine"]["cores"] == os.cpu_count()  # --quick: one repeat


def unmeasured():
    return None  # a `sample` for bench.run: noise not measured, so notes and lines never depend on this machine


def test_the_figure_tells_the_story(make_model, tmp_path):
    """`kvql.bench.run` on a tiny model, then its Figure: a titled 2x3 grid, ticks at the sizes run, y from
    zero, display names, every kvql point annotated with its speed-up and hit rate."""
    m = make_model(name="tiny-llama")
    results = bench.run(m, sizes=(2, 3), out_dir=tmp_path, progress=False, sample=unmeasured)
    fig = bench_report.plot(results)
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
                        batch_baseline=False, sample=unmeasured)
    lines = bench_report.table(results).splitlines()
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
    assert "WARNING" not in bench_report.table(results)  # unmeasured and one repeat: nothing to flag


def test_others_share_is_the_cpu_other_processes_used():
    before = {"wall": 100.0, "own": 50.0, "busy": 500.0}
    # 10 s on 4 cores = 40 CPU seconds; the machine was busy 30 of them, 12 this process's own
    after = {"wall": 110.0, "own": 62.0, "busy": 530.0}
    assert bench.others_share(before, after, cores=4) == (30 - 12) / 40
    assert bench.others_share(before, {**after, "busy": 510.0}, cores=4) == 0.0  # never below zero
    assert bench.others_share(None, after, cores=4) is None and bench.others_share(before, None, 4) is None


def test_cpu_sample_reads_this_machine():
    s = bench.cpu_sample()
    assert s is not None and s["busy"] > 0 and s["own"] > 0  # Linux: /proc/stat


def test_repeats_give_the_best_and_the_median_each_from_an_empty_cache(make_model, tmp_path):
    m = make_model()
    once = bench.run(m, workloads=("fewshot",), sizes=(3,), out_dir=tmp_path, progress=False, batch_baseline=False,
                     sample=unmeasured)["workloads"]["fewshot"][0]
    results = bench.run(m, workloads=("fewshot",), sizes=(3,), out_dir=tmp_path, progress=False,
                        batch_baseline=False, repeats=3, sample=unmeasured)
    r = results["workloads"]["fewshot"][0]
    assert results["meta"]["repeats"] == 3
    for system in ("kvql", "hf_one_at_a_time"):
        assert r["seconds"][system] <= r["median_seconds"][system]
        assert r[system] == 3 / r["seconds"][system]  # queries/s from the best time
    assert r["spread"] == max(r["median_seconds"][s] / r["seconds"][s] - 1 for s in ("kvql", "hf_one_at_a_time"))
    assert r["hit_rate"] == once["hit_rate"]  # each repeat cold: a warm second repeat would raise it
    assert once["spread"] is None  # one repeat: no spread
    line = next(x for x in bench_report.table(results).splitlines() if x.startswith("fewshot"))
    assert line.split()[2] == f"{r['seconds']['hf_one_at_a_time']:.2f}/{r['median_seconds']['hf_one_at_a_time']:.2f}"


def machine(share: float):
    """A `sample` for bench.run: every call 10 s later, this process 1 CPU second more, and other processes
    `share` of the machine's cores in between."""
    calls, cores = itertools.count(), os.cpu_count()

    def sample():
        k = next(calls)
        return {"wall": 10.0 * k, "own": 1.0 * k, "busy": k * (1.0 + share * 10 * cores)}
    return sample


def kvql_notes(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes[:5] for t in ax.texts]


def test_a_busy_machine_is_flagged_in_the_table_and_on_the_figure(make_model, tmp_path):
    m = make_model()
    busy = bench.run(m, workloads=("fewshot", "json"), sizes=(2,), out_dir=tmp_path, progress=False,
                     batch_baseline=False, sample=machine(0.6))
    assert busy["machine"]["others_share"] == pytest.approx(0.6)
    text = bench_report.table(busy)
    warning = bench_report.noise_warning(busy)
    assert warning.startswith("WARNING") and "other processes used 60% of the machine's" in warning
    assert "2 of 2 points noisy" in warning and text.count(warning) == 2  # above and below the rows
    rows = [x for x in text.splitlines() if x.startswith(("fewshot", "json"))]
    assert len(rows) == 2 and all(x.endswith("! busy 60%") for x in rows)
    fig = bench_report.plot(busy)
    title = fig.legends[0].get_title()
    assert title.get_text().replace("\n", " ") == warning and title.get_color() == "red"
    assert all(note.endswith("! busy 60%") for note in kvql_notes(fig))

    quiet = bench.run(m, workloads=("fewshot", "json"), sizes=(2,), out_dir=tmp_path, progress=False,
                      batch_baseline=False, sample=machine(0.05))
    assert bench_report.noise_warning(quiet) is None and "!" not in bench_report.table(quiet)
    fig = bench_report.plot(quiet)
    assert fig.legends[0].get_title().get_text() == "" and not any("!" in n for n in kvql_notes(fig))


def test_a_wide_spread_of_repeats_is_flagged_without_a_busy_machine(make_model, tmp_path):
    m = make_model()
    results = bench.run(m, workloads=("fewshot",), sizes=(2,), out_dir=tmp_path, progress=False,
                        batch_baseline=False, sample=machine(0.0))
    results["workloads"]["fewshot"][0]["spread"] = 0.5  # as if the median of its repeats were 1.5x the best
    warning = bench_report.noise_warning(results)
    assert "1 of 1 points noisy" in warning and "other processes" not in warning
    line = next(x for x in bench_report.table(results).splitlines() if x.startswith("fewshot"))
    assert line.endswith("! spread 50%")
    results["workloads"]["fewshot"][0]["spread"] = 0.1
    assert bench_report.noise_warning(results) is None
