"""The command line: `kvql run FILE.lmql --model DIR --input k=v`."""

from __future__ import annotations

import subprocess
import sys


def test_kvql_run_executes_a_query_file_with_inputs(tmp_path, llama, tokenizer):
    llama.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    query = tmp_path / "q.lmql"
    query.write_text('argmax\n    "Say {word}: [X]" where X in ["alpha", "beta"]\n    return word + "=" + X\n')
    out = subprocess.run([sys.executable, "-m", "kvql.cli", "run", str(query), "--model", str(tmp_path / "model"),
                          "--input", "word=hello"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("hello=alpha", "hello=beta")


def test_kvql_run_reports_a_syntax_error_with_its_position(tmp_path):
    query = tmp_path / "bad.lmql"
    query.write_text('"ok"\n"broken [1abc]"\n')
    out = subprocess.run([sys.executable, "-m", "kvql.cli", "run", str(query)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2
    assert f"{query}:2:9: " in out.stderr and "invalid hole" in out.stderr
    assert out.stderr.splitlines()[-2:] == ['    "broken [1abc]"', "            ^"]  # the line, a caret at column 9


def test_kvql_run_with_a_cache_dir_serves_the_next_run_from_it(tmp_path, llama, tokenizer):
    llama.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    query = tmp_path / "q.lmql"
    query.write_text('argmax\n    "A long shared instruction that every run of this query repeats. Say hi: [X]" '
                     'where len(TOKENS(X)) < 4\n')

    def run():
        out = subprocess.run([sys.executable, "-m", "kvql.cli", "run", str(query), "--model", str(tmp_path / "model"),
                              "--cache-dir", str(tmp_path / "kv"), "--stats"], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        stats = next(line for line in out.stderr.splitlines() if line.startswith("tokens "))
        return out.stdout, int(stats.split("cached ")[1].split(",")[0])

    first, cached_first = run()
    second, cached_second = run()
    assert cached_first == 0 and cached_second > 10  # the new process found the prompt on disk
    assert second == first
    bad = subprocess.run([sys.executable, "-m", "kvql.cli", "run", str(query), "--model", "http://127.0.0.1:9/v1",
                          "--cache-dir", str(tmp_path / "kv")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--disk-cache (--cache-dir) is for local models" in bad.stderr


def test_kvql_generate_names_each_prompt_and_decodes_stop_escapes(monkeypatch, capsys):
    import kvql
    from kvql.cli import main

    class Fake:
        def generate(self, prompts, **options):
            self.options = options
            return [type("C", (), {"text": f" answer {i}"})() for i in range(len(prompts))]

        def close(self):
            pass

    fake = Fake()
    monkeypatch.setattr(kvql, "model", lambda *a, **k: fake)
    main(["generate", "Q: first?", "Q: " + "x" * 80, "--stop", "\\n", "--stop", "\\tEND"])
    assert fake.options["stop"] == ["\n", "\tEND"]
    assert capsys.readouterr().out.splitlines() == [
        "--- prompt 1/2: 'Q: first?' ---", " answer 0",
        f"--- prompt 2/2: {'Q: ' + 'x' * 54 + '...'!r} ---", " answer 1"]
    main(["generate", "only one"])
    assert capsys.readouterr().out == " answer 0\n"  # one prompt: its text alone, as before


def test_kvql_generate_runs_several_prompts_on_a_real_model(tmp_path, llama, tokenizer):
    llama.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = subprocess.run([sys.executable, "-m", "kvql.cli", "generate", "one", "two",
                          "--model", str(tmp_path / "model"), "--dtype", "float32", "--max-tokens", "3", "--stop", "\\n"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "--- prompt 1/2: 'one' ---" and "--- prompt 2/2: 'two' ---" in lines
