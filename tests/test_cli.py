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
    assert "line 2" in out.stderr and "invalid hole" in out.stderr
