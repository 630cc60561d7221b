"""Traces: per-token cached / computed marks that agree with the engine's counts; JSON and HTML forms."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvql

QUERY = '''
"Question: what is the capital of France? [A] and then [B]" where len(TOKENS(A)) < 4 and len(TOKENS(B)) < 4
"Choose: [C]" where C in ["red", "green"]
'''


@pytest.fixture
def m(make_model):
    return make_model()


def test_trace_marks_agree_with_the_engines_counts(m):
    first = kvql.run_sync(QUERY, model=m)
    t = first.trace
    s = t.summary()
    assert s["computed"] == first.computed_tokens  # each computed token counted once, as the engine does
    assert s["tokens"] == len(t.tokens) and s["generated"] == sum(1 for x in t.tokens if x.hole)
    assert [h.name for h in t.holes] == ["A", "B", "C"]
    assert "".join(x.text for x in t.tokens) == first.prompt


def test_a_second_run_is_cached_except_the_last_token_of_each_request(m):
    kvql.run_sync(QUERY, model=m)
    second = kvql.run_sync(QUERY, model=m)
    t = second.trace
    computed = [i for i, x in enumerate(t.tokens) if x.served == "computed"]
    assert len(computed) == 3 == second.computed_tokens  # one per hole request
    # each computed token is the last one the engine was sent before a hole
    starts = [i for i, x in enumerate(t.tokens) if x.hole and (i == 0 or t.tokens[i - 1].hole != x.hole)]
    assert computed == [i - 1 for i in starts]


def test_json_and_html_forms_hold_the_same_counts(m, tmp_path):
    r = kvql.run_sync(QUERY, model=m)
    r.trace.save(tmp_path / "t.json")
    r.trace.save(tmp_path / "t.html")
    data = json.loads((tmp_path / "t.json").read_text())
    page = (tmp_path / "t.html").read_text()
    for kind in ("cached", "computed", "unsent"):
        assert page.count(f'data-served="{kind}"') == data["summary"][kind]
    assert "http" not in page.split("<body>")[1]  # self-contained: no external assets


def test_queries_with_return_keep_their_trace_on_the_query(m):
    q = kvql.query('"Pick [X]" where X in ["a", "b"]\nreturn X', is_async=False)
    assert q(model=m) in ("a", "b")
    assert q.last_trace.holes[0].name == "X"


def test_kvql_run_writes_a_trace_and_prints_stats(tmp_path, llama, tokenizer):
    llama.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "q.lmql").write_text('"Say: [X]" where X in ["hi", "yo"]\n')
    out = subprocess.run([sys.executable, "-m", "kvql.cli", "run", str(tmp_path / "q.lmql"), "--model",
                          str(tmp_path / "model"), "--trace", str(tmp_path / "t.html"), "--stats"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "t.html").read_text().startswith("<!doctype html>")
    assert "computed" in out.stderr and "hit rate" in out.stderr
