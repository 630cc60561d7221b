"""`kvql run` on a real (tiny, random) model: the start-up banner, decoder flags, labelled samples, one
trace per sample, and a clear line for a device this torch cannot use."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

SAMPLED = 'sample(n=3, temperature=1.5)\n    "Say something:[X]" where len(TOKENS(X)) < 6\n'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, llama, tokenizer):
    d = tmp_path_factory.mktemp("cli-model")
    llama.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def kvql(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "kvql.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300, env=env)


def test_start_up_prints_a_loading_line_then_one_banner_line(tmp_path, model_dir, llama):
    (tmp_path / "q.lmql").write_text('"Hi[X]" where len(TOKENS(X)) < 3\n')
    out = kvql("run", "q.lmql", "--model", str(model_dir), "--cache-budget", "1MiB", "--dtype", "float32", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[0] == f"kvql: loading {model_dir} on cpu ..."
    banner = [x for x in lines if x.startswith("kvql: model ")]
    assert len(banner) == 1, out.stderr
    cfg = llama.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    slots = 2**20 // per_token
    assert (f"device cpu · float32 · context {cfg.max_position_embeddings} tokens · KV cache {slots:,} tokens "
            f"({slots * per_token / 2**20:.1f} MiB)") in banner[0]
    assert re.search(r"loaded in \d+\.\d s$", banner[0])
    assert "kvql: model" not in out.stdout  # stdout holds the result only


def test_samples_are_labelled_and_one_trace_file_holds_them_all(tmp_path, model_dir):
    (tmp_path / "s.lmql").write_text(SAMPLED)
    out = kvql("run", "s.lmql", "--model", str(model_dir), "--cache-budget", "1MiB", "--seed", "7",
               "--trace", "t.json", "--stats", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    labels = [x for x in out.stdout.splitlines() if x.startswith("--- sample")]
    assert labels == ["--- sample 1/3 ---", "--- sample 2/3 ---", "--- sample 3/3 ---"]
    traces = json.loads((tmp_path / "t.json").read_text())["traces"]
    values = [t["holes"][0]["value"] for t in traces]
    printed = [eval(x.split(": ", 1)[1]) for x in out.stdout.splitlines() if x.startswith("X: ")]
    assert len(values) == 3 and values == printed  # each section is its own sample's trace, in order
    assert "trace written to t.json (3 samples)" in out.stderr and "sample 3/3: tokens" in out.stderr
    out = kvql("run", "s.lmql", "--model", str(model_dir), "--cache-budget", "1MiB", "--seed", "7",
               "--trace", "t.html", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "t.html").read_text().count('<section class="sample"') == 3


def test_seed_makes_samples_repeatable_and_the_decoder_flag_overrides_the_query(tmp_path, model_dir):
    (tmp_path / "s.lmql").write_text(SAMPLED)
    args = ("run", "s.lmql", "--model", str(model_dir), "--cache-budget", "1MiB")
    a = kvql(*args, "--seed", "11", cwd=tmp_path)
    b = kvql(*args, "--seed", "11", cwd=tmp_path)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout
    greedy = kvql(*args, "--decoder", "argmax", cwd=tmp_path)
    assert greedy.returncode == 0, greedy.stderr
    assert "--- sample" not in greedy.stdout and greedy.stdout.count("X: ") == 1  # argmax: one run
    two = kvql(*args, "--decoder", "sample(n=2)", "--temperature", "0.7", "--seed", "3", cwd=tmp_path)
    assert two.returncode == 0, two.stderr
    assert [x for x in two.stdout.splitlines() if x.startswith("--- sample")] == ["--- sample 1/2 ---",
                                                                                 "--- sample 2/2 ---"]


def test_an_unknown_decoder_is_a_one_line_error(tmp_path, model_dir):
    (tmp_path / "s.lmql").write_text(SAMPLED)
    out = kvql("run", "s.lmql", "--model", str(model_dir), "--decoder", "greedyish", cwd=tmp_path)
    assert out.returncode == 2 and "unknown decoder 'greedyish'" in out.stderr and "Traceback" not in out.stderr


def test_cuda_without_a_usable_gpu_is_one_clear_line(tmp_path, model_dir):
    """On this CPU-only torch, and on a CUDA build with no GPU visible (CUDA_VISIBLE_DEVICES empty)."""
    (tmp_path / "q.lmql").write_text('"Hi[X]" where len(TOKENS(X)) < 3\n')
    out = kvql("run", "q.lmql", "--model", str(model_dir), "--device", "cuda", cwd=tmp_path,
               env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2
    errors = [x for x in out.stderr.splitlines() if not x.startswith("kvql: loading")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert errors[0].startswith("kvql: error: device 'cuda'") and "--device cpu" in errors[0]


# -- --stream writes each piece of the prompt once ----------------------------------------------------------
INT_THEN_TEXT = '"Question:[N]" where INT(N) and len(TOKENS(N)) < 4\n" and then:[X]" where len(TOKENS(X)) < 5\n'


def test_stream_writes_the_prompt_once_when_an_int_holes_text_is_rewritten(tmp_path, model_dir):
    """INT(N) grows as '041' on this model but its value, in the prompt, is 41: the stream keeps the text it
    showed and goes on from the prompt after the value, so nothing is written twice."""
    (tmp_path / "q.lmql").write_text(INT_THEN_TEXT)
    out = kvql("run", "q.lmql", "--model", str(model_dir), "--cache-budget", "1MiB", "--dtype", "float32",
               "--stream", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    prompt, rest = out.stdout.split("\nN: ", 1)  # the final prompt, then the variables
    value = rest.split("\n", 1)[0]
    banner = next(x for x in out.stderr.splitlines() if x.startswith("kvql: model "))
    streamed = out.stderr.split(banner + "\n", 1)[1]
    assert streamed.startswith("Question:") and not streamed.startswith(f"Question:{value}")  # it was rewritten
    assert streamed.count("Question:") == 1 and streamed.count(" and then:") == 1
    assert streamed.endswith(prompt[len("Question:" + value):] + "\n")
    assert 0 < len(streamed) - len(prompt + "\n") <= 3  # the shown text's extra zeros or space only


def written(calls) -> str:
    """What a TerminalWriter writes for `calls` of (variable, prompt, values, growing hole or None = final)."""
    import asyncio
    import io

    from kvql.output import TerminalWriter
    from kvql.runtime.program_state import ProgramState

    out = io.StringIO()
    writer = TerminalWriter(out)
    for variable, prompt, values, growing in calls:
        state = ProgramState(prompt, values, growing=growing)
        asyncio.run(writer.add_interpreter_head_state(variable, 0, prompt, None, None, True, growing is None, None,
                                                      1, state))
    return out.getvalue()


def test_stream_ends_once_when_the_last_holes_text_is_rewritten():
    assert written([("N", "Q: 0", {"N": " 0"}, "N"), ("N", "Q: 04", {"N": " 04"}, "N"),
                    ("N", "Q:4", {"N": 4}, None)]) == "Q: 04\n"


def test_stream_starts_another_samples_prompt_on_a_new_line():
    assert written([("X", "Say: ab", {"X": " ab"}, "X"), ("X", "Say: c", {"X": " c"}, "X"),
                    ("X", "Say: cd", {"X": " cd"}, "X")]) == "Say: ab\nSay: cd"
