"""The README's tour runs as written and answers what its `# -> VALUE` comments say, on the embedded models
with their default options: the expected values are read from README.md, so the two cannot drift."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
EXPECTED = re.compile(r"#\s*->\s*(.+?)\s*$")
GEMMA = 'lmql.model("gemma3-270m"'  # the line where the tour turns from SmolLM2 to Gemma 3


def tour() -> str:
    """The Python code block of the README's "## A tour" section."""
    section = README.read_text(encoding="utf-8").split("## A tour", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def parts() -> tuple[str, str]:
    """The tour split where it loads Gemma 3: (its imports and the SmolLM2 part, its imports and the Gemma
    part); each runs on its own."""
    lines = tour().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if GEMMA in line)
    imports = "".join(line for line in lines[:at] if line.startswith("import "))
    return "".join(lines[:at]), imports + "".join(lines[at:])


def expectations(code: str) -> dict[int, object]:
    """The expected values in `code`: statement index -> VALUE, for each expression statement whose last
    line ends with `# -> VALUE` (VALUE a Python literal)."""
    lines, found = code.splitlines(), {}
    for i, node in enumerate(ast.parse(code).body):
        match = EXPECTED.search(lines[node.end_lineno - 1])
        if isinstance(node, ast.Expr) and match:
            found[i] = ast.literal_eval(match.group(1))
    return found


def run_checked(code: str, file: Path) -> list[tuple[str, object, object]]:
    """Run `code` statement by statement; -> (source, value, expected) for each statement `expectations`
    names. The code is written to `file` first and compiled as that file's: a query reads its own source
    there, as it does in a user's script."""
    file.write_text(code, encoding="utf-8")
    expected, namespace, checked = expectations(code), {}, []
    for i, node in enumerate(ast.parse(code).body):
        if i in expected:
            value = eval(compile(ast.Expression(node.value), str(file), "eval"), namespace)
            checked.append((ast.get_source_segment(code, node), value, expected[i]))
        else:
            exec(compile(ast.Module([node], []), str(file), "exec"), namespace)
    return checked


def test_the_tour_has_expected_values_to_check():
    smol, gemma = parts()
    assert len(expectations(smol)) >= 3 and len(expectations(gemma)) >= 1


@pytest.mark.smollm2
def test_the_tour_answers_as_the_readme_shows_on_smollm2(tmp_path):
    checked = run_checked(parts()[0], tmp_path / "tour.py")
    assert len(checked) >= 3
    assert [(src, got) for src, got, _ in checked] == [(src, want) for src, _, want in checked]


@pytest.mark.gemma3
def test_the_tour_answers_as_the_readme_shows_on_gemma3(tmp_path):
    checked = run_checked(parts()[1], tmp_path / "tour.py")
    assert len(checked) >= 1
    assert [(src, got) for src, got, _ in checked] == [(src, want) for src, _, want in checked]
