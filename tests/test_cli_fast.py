"""The command line answers at once when no model is needed: --help, --version, argument errors, and a
query's missing or misspelled inputs (checked before anything heavy is imported or loaded)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata

from conftest import free_port

QUERY = ('argmax\n'
         '    "Q: What is the capital of {country}? ({lang})\\nA:[ANSWER]" where STOPS_AT(ANSWER, "\\n")\n'
         '    return ANSWER\n')


def kvql(*args, cwd=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "kvql.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def imported_after(argv: list[str], cwd=None) -> set[str]:
    """The heavy modules `main(argv)` imported, run in a fresh interpreter."""
    code = ("import sys\nfrom kvql.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('IMPORTED', sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=cwd, timeout=60)
    line = [x for x in out.stdout.splitlines() if x.startswith("IMPORTED")][-1]
    return set(eval(line.split(" ", 1)[1]))


# "at once" is asserted as what it rests on, nothing heavy imported, not as a time (this machine is shared)
def test_help_imports_neither_torch_nor_transformers():
    out = kvql("--help")
    assert out.returncode == 0 and "run" in out.stdout and "serve" in out.stdout
    assert imported_after(["--help"]) == set()
    assert imported_after(["serve", "--help"]) == set()


def test_argument_errors_import_neither_torch_nor_transformers():
    for argv in (["run"], ["run", "q.lmql", "--no-such-flag"], ["frobnicate"], ["generate", "x", "--max-tokens", "many"]):
        out = kvql(*argv)
        assert out.returncode == 2, (argv, out.stderr)
        assert "usage: kvql" in out.stderr and "Traceback" not in out.stderr
        assert imported_after(argv) == set(), argv


def test_version_comes_from_the_package_metadata():
    out = kvql("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"kvql {metadata.version('kvql')}"


def test_a_missing_input_is_named_before_any_model_is_loaded(tmp_path):
    (tmp_path / "q.lmql").write_text(QUERY)
    out = kvql("run", "q.lmql", "--input", "country=Italy", "--model", "no-such-model", cwd=tmp_path)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "loading" not in out.stderr
    assert "missing --input lang=" in out.stderr and "its inputs: country, lang" in out.stderr
    assert "torch" not in imported_after(["run", "q.lmql", "--input", "country=Italy"], cwd=tmp_path)


def test_a_misspelled_input_names_the_expected_ones(tmp_path):
    (tmp_path / "q.lmql").write_text(QUERY)
    out = kvql("run", "q.lmql", "--input", "contry=Italy", "--input", "lang=en", cwd=tmp_path)
    assert out.returncode == 2
    assert "unknown input 'contry'" in out.stderr and "missing --input country=" in out.stderr
    assert "its inputs: country, lang" in out.stderr and "loading" not in out.stderr


def test_an_input_to_a_query_without_inputs_is_refused(tmp_path):
    (tmp_path / "q.lmql").write_text('"Hello[X]" where len(TOKENS(X)) < 3\n')
    out = kvql("run", "q.lmql", "--input", "name=Bob", cwd=tmp_path)
    assert out.returncode == 2 and "unknown input 'name'" in out.stderr and "its inputs: none" in out.stderr


def test_bad_run_arguments_are_one_line_errors(tmp_path):
    (tmp_path / "q.lmql").write_text(QUERY)
    cases = {("run", "nope.lmql"): "cannot read query file 'nope.lmql'",
             ("run", "q.lmql", "--input", "country"): "--input takes NAME=VALUE",
             ("run", "q.lmql", "--decoder", "sample(n="): "--decoder takes a decoder",
             ("run", "q.lmql", "--decoder", "sample(n=k)"): "--decoder takes a decoder"}
    for argv, message in cases.items():
        out = kvql(*argv, cwd=tmp_path)
        assert out.returncode == 2, argv
        assert message in out.stderr and "Traceback" not in out.stderr, (argv, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


# -- every argument checked before a model loads ----------------------------------------------------
SPY = ("import sys\n"
       "import kvql.backends.loader as loader\n"
       "def loaded(*args, **kwargs):\n"
       "    print('MODEL LOAD ATTEMPTED', flush=True)\n"
       "    raise SystemExit(99)\n"
       "loader.load_hf = loader.random_model = loaded\n"
       "from kvql.cli import main\n"
       "main(sys.argv[1:])\n")


def without_loading(*argv, cwd):
    """`kvql ARGV` in a fresh interpreter whose model loader, if called, says so and exits 99."""
    return subprocess.run([sys.executable, "-c", SPY, *argv], capture_output=True, text=True, cwd=cwd, timeout=120)


def bad_arguments(tmp_path) -> dict:
    (tmp_path / "q.lmql").write_text('"Hi[X]" where len(TOKENS(X)) < 3\n')
    (tmp_path / "regex.lmql").write_text('argmax\n    "Hi [X]" where REGEX(X, r"[a-z+")\nfrom "smollm2-135m"\n')
    (tmp_path / "a-file").write_text("x")
    port = str(free_port())
    return {
        ("run", "q.lmql", "--cache-budget", "5XB"): "argument --cache-budget: cannot read '5XB' as a size",
        ("generate", "hi", "--cache-budget", "0"): "'0' is no size > 0",
        ("serve", "--port", port, "--cache-budget", "5XB"): "argument --cache-budget: cannot read '5XB'",
        ("bench", "fewshot", "nosuch"): "unknown workload 'nosuch'; known: fewshot, chat, tot, json, classify",
        ("bench", "--repeats", "0"): "argument --repeats: must be at least 1, got 0",
        ("bench", "--out", "a-file"): "argument --out: 'a-file' exists and is not a directory",
        ("bench", "--threads", "-2"): "argument --threads: must be at least 0",
        ("run", "q.lmql", "--cache-dir", "a-file"): "argument --disk-cache/--cache-dir: 'a-file' exists and is not a directory",
        ("serve", "--port", port, "--cache-dir", "a-file/kv"): "cannot be created: a-file is not a directory",
        ("serve", "--port", port, "--cache-save-interval", "-1"): "must be a number >= 0",
        ("serve", "--port", "70000"): "argument --port: must be from 1 to 65535",
        ("serve", "--port", port, "--max-tokens-cap", "0"): "argument --max-tokens-cap: must be at least 1",
        ("run", "q.lmql", "--trace", "no-dir/t.html"): "directory 'no-dir' does not exist",
        ("run", "q.lmql", "--temperature", "-1"): "argument --temperature: must be a number >= 0",
        ("generate", "hi", "--max-tokens", "0"): "argument --max-tokens: must be at least 1",
        ("generate", "hi", "--stop", "a\\d"): "'\\\\d' at character 1 starts no escape",
        ("demo", "--dtype", "fp64"): "argument --dtype: invalid choice: 'fp64'",
        ("serve", "--port", port, "--dtype", "int8"): "argument --dtype: invalid choice: 'int8'",
        # what needs torch to check (a device) is checked before the "loading" line, still without a load
        ("generate", "hi", "--device", "nosuchdevice"): "unknown device 'nosuchdevice'",
        ("serve", "--port", port, "--device", "nosuchdevice"): "unknown device 'nosuchdevice'",
        ("run", "q.lmql", "--device", "nosuchdevice"): "unknown device 'nosuchdevice'",
        ("bench", "--device", "nosuchdevice"): "unknown device 'nosuchdevice'",
        # the query's regexes and decoder, before the load (the query names its model)
        ("run", "regex.lmql"): "regex.lmql:2:29: REGEX(X, '[a-z+'): invalid regex: unclosed character class",
        ("run", "q.lmql", "--decoder", "beem(n=2)"): "unknown decoder 'beem'",
        ("run", "q.lmql", "--decoder", "sample(n=0)"): "n and the beam width must be >= 1",
        ("run", "q.lmql", "--api-key", "k"): "--api-key is for a server's model",
        ("generate", "hi", "--api-key", "k"): "--api-key is for a server's model",
    }


def test_every_bad_argument_is_refused_before_any_model_load(tmp_path):
    for argv, message in bad_arguments(tmp_path).items():
        out = without_loading(*argv, cwd=tmp_path)
        assert "MODEL LOAD ATTEMPTED" not in out.stdout, (argv, out.stdout)
        assert out.returncode == 2, (argv, out.returncode, out.stderr)
        assert message in out.stderr and "Traceback" not in out.stderr, (argv, out.stderr)
        assert "loading" not in out.stderr + out.stdout, (argv, out.stderr)


def test_the_spy_sees_a_load_when_the_arguments_are_good(tmp_path):
    # the test above would pass vacuously if the spy could not see a load
    out = without_loading("generate", "hi", "--model", "random", "--cache-budget", "1MB", cwd=tmp_path)
    assert out.returncode == 99 and "MODEL LOAD ATTEMPTED" in out.stdout, out.stderr


def test_a_python_api_model_checks_its_options_before_loading(monkeypatch, tmp_path):
    import pytest

    import kvql
    import kvql.backends.loader as loader

    def loaded(*args, **kwargs):
        raise AssertionError("a model load was attempted")

    monkeypatch.setattr(loader, "load_hf", loaded)
    monkeypatch.setattr(loader, "random_model", loaded)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match="cannot read '5XB' as a size"):
        kvql.model("smollm2-135m", cache_budget="5XB", silent=False)
    with pytest.raises(ValueError, match="exists and is not a directory"):
        kvql.model("random", cache_dir=tmp_path / "a-file")
    with pytest.raises(ValueError, match="cache_save_interval must be >= 0"):
        kvql.model("random", cache_dir=tmp_path, cache_save_interval=-1)
    with pytest.raises(ValueError, match="not one of auto, float32"):
        kvql.model("smollm2-135m", dtype="int8")


# -- help ---------------------------------------------------------------------------------------------
def test_every_option_of_every_command_has_help_and_shows_its_default():
    from kvql.cli import parser

    commands = parser()._subparsers._group_actions[0].choices
    for name, p in commands.items():
        options = p.format_help().split("options:", 1)[1]
        entries = {" ".join(e.split()).split(" ", 1)[0].rstrip(","): " ".join(e.split())
                   for e in re.split(r"\n  (?=-)", options)[1:]}
        for action in p._actions:
            if action.option_strings == ["-h", "--help"]:
                continue
            assert action.help, f"kvql {name} {action.option_strings or action.dest}: no help"
            if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS):
                entry = entries[action.option_strings[0]]
                assert "default" in entry, (name, entry)
    serve = commands["serve"].format_help()
    for expected in ("(default: smollm2-135m)", "(default: 127.0.0.1)", "(default: 8000)", "(default: auto)",
                     "(default: 4096)"):
        assert expected in " ".join(serve.split()), expected


# -- generate: --stop escapes -------------------------------------------------------------------------
def test_generate_reads_backslash_escapes_in_stop_as_python_does():
    from kvql.cli import parser

    args = parser().parse_args(["generate", "x", "--stop", "\\n", "--stop", "a\\tb", "--stop", "\\\\n",
                                "--stop", "\\x41\\u00e9", "--stop", "plain"])
    assert args.stop == ["\n", "a\tb", "\\n", "Aé", "plain"]


def test_generate_reads_the_same_escapes_in_its_prompts():
    from kvql.cli import parser

    args = parser().parse_args(["generate", "Q: 2 + 2?\\nA:", "a \\\\n b", "--stop", "\\n"])
    assert args.prompt == ["Q: 2 + 2?\nA:", "a \\n b"] and args.stop == ["\n"]


# -- every command line the docs show -------------------------------------------------------------------
def documented_commands() -> list[tuple[str, list[str]]]:
    """(page, argv) of every `kvql ...` / `./dev kvql ...` line in a bash block of the README and docs/, with
    its comment and its optional `[...]` parts left out."""
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.splitlines():
                line = re.sub(r"\s+#\s.*$", "", re.sub(r"\s\[[^\]]*\]", "", line)).strip()
                for part in line.split("&&"):
                    words = shlex.split(part)
                    if words[:2] == ["./dev", "kvql"]:
                        words = words[1:]
                    if words[:1] == ["kvql"] and len(words) > 1 and not words[1].startswith("-"):
                        found.append((page.name, words[1:]))
    return found


def test_every_command_line_in_the_docs_parses_as_documented():
    """Each documented command line is one the CLI takes (its flags exist, its values pass their checks), and
    the guide's `kvql generate` example sends prompts with real newlines, as its --stop '\\n' reads them."""
    from kvql.cli import parser

    commands = documented_commands()
    assert len(commands) >= 8 and {argv[0] for _, argv in commands} >= {"run", "serve", "generate", "bench"}
    for page, argv in commands:
        try:
            args = parser().parse_args(argv)
        except SystemExit:
            raise AssertionError(f"{page}: kvql {' '.join(argv)}") from None
        if argv[0] == "generate":
            assert all("\n" in p and "\\n" not in p for p in args.prompt) and args.stop == ["\n"], (page, argv)
