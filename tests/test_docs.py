"""The documentation: the README is the front door (the two commands first, short), and docs/ builds as a
site with `mkdocs build --strict` (a broken page link or a page missing from the nav fails it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_opens_with_the_two_commands_and_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[2:6] == ["```bash", "./dev demo    # few-shot questions on the embedded SmolLM2-135M, cold then warm cache",
                          "./dev test    # the test suite (pytest)", "```"]
    assert len(lines) <= 150
    for page in ("install", "guide", "lmql", "server", "models", "engine", "benchmarks", "architecture"):
        assert f"(docs/{page}.md)" in "\n".join(lines), page


def test_the_docs_build_as_a_site_in_strict_mode(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "architecture" / "index.html").exists()
