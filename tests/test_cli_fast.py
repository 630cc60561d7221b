"""The command line answers at once when no model is needed: --help, --version, argument errors, and a
query's missing or misspelled inputs (checked before anything heavy is imported or loaded)."""

from __future__ import annotations

import subprocess
import sys
import time
from importlib import metadata

QUERY = ('argmax\n'
         '    "Q: What is the capital of {country}? ({lang})\\nA:[ANSWER]" where STOPS_AT(ANSWER, "\\n")\n'
         '    return ANSWER\n')


def kvql(*args, cwd=None, timeout=60):
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "kvql.cli", *args], capture_output=True, text=True, cwd=cwd,
                         timeout=timeout)
    return out, time.perf_counter() - t0


def imported_after(argv: list[str], cwd=None) -> set[str]:
    """The heavy modules `main(argv)` imported, run in a fresh interpreter."""
    code = ("import sys\nfrom kvql.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('IMPORTED', sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=cwd, timeout=60)
    line = [x for x in out.stdout.splitlines() if x.startswith("IMPORTED")][-1]
    return set(eval(line.split(" ", 1)[1]))


def test_help_returns_in_under_a_second_without_torch():
    out, seconds = kvql("--help")
    assert out.returncode == 0 and "run" in out.stdout and "serve" in out.stdout
    assert seconds < 1.0, f"kvql --help took {seconds:.2f} s"
    assert imported_after(["--help"]) == set()
    assert imported_after(["serve", "--help"]) == set()


def test_argument_errors_return_in_under_a_second():
    for argv in (["run"], ["run", "q.lmql", "--no-such-flag"], ["frobnicate"], ["generate", "x", "--max-tokens", "many"]):
        out, seconds = kvql(*argv)
        assert out.returncode == 2, (argv, out.stderr)
        assert "usage: kvql" in out.stderr and "Traceback" not in out.stderr
        assert seconds < 1.0, f"kvql {' '.join(argv)} took {seconds:.2f} s"


def test_version_comes_from_the_package_metadata():
    out, _ = kvql("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"kvql {metadata.version('kvql')}"


def test_a_missing_input_is_named_before_any_model_is_loaded(tmp_path):
    (tmp_path / "q.lmql").write_text(QUERY)
    out, seconds = kvql("run", "q.lmql", "--input", "country=Italy", "--model", "no-such-model", cwd=tmp_path)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "loading" not in out.stderr
    assert "missing --input lang=" in out.stderr and "its inputs: country, lang" in out.stderr
    assert seconds < 5.0, f"the input check took {seconds:.2f} s"
    assert "torch" not in imported_after(["run", "q.lmql", "--input", "country=Italy"], cwd=tmp_path)


def test_a_misspelled_input_names_the_expected_ones(tmp_path):
    (tmp_path / "q.lmql").write_text(QUERY)
    out, seconds = kvql("run", "q.lmql", "--input", "contry=Italy", "--input", "lang=en", cwd=tmp_path)
    assert out.returncode == 2
    assert "unknown input 'contry'" in out.stderr and "missing --input country=" in out.stderr
    assert "its inputs: country, lang" in out.stderr
    assert seconds < 5.0


def test_an_input_to_a_query_without_inputs_is_refused(tmp_path):
    (tmp_path / "q.lmql").write_text('"Hello[X]" where len(TOKENS(X)) < 3\n')
    out, _ = kvql("run", "q.lmql", "--input", "name=Bob", cwd=tmp_path)
    assert out.returncode == 2 and "unknown input 'name'" in out.stderr and "its inputs: none" in out.stderr


def test_bad_run_arguments_are_one_line_errors(tmp_path):
    (tmp_path / "q.lmql").write_text(QUERY)
    cases = {("run", "nope.lmql"): "cannot read query file 'nope.lmql'",
             ("run", "q.lmql", "--input", "country"): "--input takes NAME=VALUE",
             ("run", "q.lmql", "--decoder", "sample(n="): "--decoder takes a decoder",
             ("run", "q.lmql", "--decoder", "sample(n=k)"): "--decoder takes a decoder"}
    for argv, message in cases.items():
        out, _ = kvql(*argv, cwd=tmp_path)
        assert out.returncode == 2, argv
        assert message in out.stderr and "Traceback" not in out.stderr, (argv, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
