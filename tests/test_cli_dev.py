"""`./dev kvql ...` runs in the caller's directory: relative paths to the query, the model and the trace
are the user's, wherever the checkout is."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_dev_kvql_resolves_relative_paths_against_the_callers_directory(tmp_path, llama, tokenizer):
    llama.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "q.lmql").write_text('argmax\n    "Say {word}:[X]" where X in [" a", " b"]\n    return X\n')
    out = subprocess.run([str(REPO / "dev"), "kvql", "run", "q.lmql", "--model", "../tiny", "--cache-budget", "1MiB",
                          "--input", "word=hi", "--trace", "t.html"],
                         cwd=tmp_path / "work", capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("a", "b")
    assert "<html" in (tmp_path / "work" / "t.html").read_text()
    assert not (REPO / "t.html").exists() and not (REPO / "q.lmql").exists()


def test_dev_kvql_help_works_from_another_directory(tmp_path):
    out = subprocess.run([str(REPO / "dev"), "kvql", "--help"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "usage: kvql" in out.stdout


def test_dev_docs_builds_the_site_strictly_and_an_unknown_command_shows_it_in_the_usage(tmp_path):
    out = subprocess.run([str(REPO / "dev"), "docs", "-q", "-d", str(tmp_path / "site")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "index.html").exists() and not (tmp_path / "mkdocs.yml").exists()
    wrong = subprocess.run([str(REPO / "dev"), "no-such-command"], capture_output=True, text=True, timeout=600)
    assert wrong.returncode == 2 and "docs [serve]" in wrong.stderr


def test_site_is_ignored_by_git():
    assert "site/" in (REPO / ".gitignore").read_text().splitlines()
