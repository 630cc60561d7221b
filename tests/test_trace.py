"""Traces: per-token cached / computed marks that agree with the engine's counts; JSON and HTML forms."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvql
from kvql.runtime.constraints import And, Atom
from kvql.runtime.hole_plan import HolePlan
from kvql.runtime.trace import Trace, TraceHole, TraceToken, save_all, where_text

QUERY = '''
"Question: what is the capital of France? [A] and then [B]" where len(TOKENS(A)) < 4 and len(TOKENS(B)) < 4
"Choose: [C]" where C in ["red", "green"]
'''


@pytest.fixture
def m(make_model):
    model = make_model()
    # every mask waited for: a mask late for its step's budget is sampled from, not forced (outputs.py), so on a
    # busy machine what a trace marks forced would depend on the clock
    model.engine.outputs.bounded_masks = False
    return model


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
    assert data["counts"] == r.trace.counts()
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


def test_counts_add_up_by_origin_and_by_how_each_token_was_served(m):
    kvql.run_sync(QUERY, model=m)
    t = kvql.run_sync(QUERY, model=m).trace
    c = t.counts()
    for origin in ("prompt", "generated", "all"):
        assert c[origin]["total"] == c[origin]["cached"] + c[origin]["computed"] + c[origin]["unsent"]
    for k in ("cached", "computed", "unsent", "total"):
        assert c["all"][k] == c["prompt"][k] + c["generated"][k]
    assert c["all"]["total"] == len(t.tokens) and c["generated"]["total"] == t.summary()["generated"] > 0
    assert c["generated"]["unsent"] > 0  # the last hole's value: no request ever sent it


def test_the_models_own_output_reused_from_the_cache_counts_as_cached(m):
    t = kvql.run_sync(QUERY, model=m).trace
    # [A]'s value was made by the model; the request for [B] sent it back and the engine had its KV
    a = [x for x in t.tokens if x.hole == "A"]
    assert len(a) >= 2 and all(x.served == "cached" for x in a[:-1])
    assert t.counts()["generated"]["cached"] >= len(a) - 1
    page = t.to_html()
    assert page.count('class="tok cached gen"') == t.counts()["generated"]["cached"]
    assert "reused from the cache" in page


def test_where_text_is_the_where_clause_as_written():
    c = And((Atom("stops_at", "X", "\n"), Atom("len", "Y", ("tokens", "<", 4)), Atom("in", "X", ("a", "b"))))
    assert where_text(c, "X") == "STOPS_AT(X, '\\n') and X in ['a', 'b']"
    assert where_text(c, "Y") == "len(TOKENS(Y)) < 4"
    assert where_text(None, "X") == "" and where_text(True, "X") == ""
    plan = HolePlan()
    plan.require("[0-9]+", "[N: int]")
    assert where_text(Atom("len", "N", ("chars", "<", 5)), "N", plan) == "len(N) < 5 and [N: int]"


def test_each_hole_shows_its_where_clause_not_an_internal_repr(m):
    t = kvql.run_sync(QUERY, model=m).trace
    assert [h.constraints for h in t.holes] == ["len(TOKENS(A)) < 4", "len(TOKENS(B)) < 4", "C in ['red', 'green']"]
    page = t.to_html()
    assert "HolePlan" not in page
    assert "[C] where C in [&#x27;red&#x27;, &#x27;green&#x27;]" in page


def test_a_query_trace_is_titled_with_its_name_model_inputs_and_date(make_model):
    m = make_model(name="tiny-llama")

    @kvql.query(model=m, is_async=False)
    def greet(who):
        '''lmql
        "Hello {who}: [X]" where len(TOKENS(X)) < 3
        '''

    greet("Ada")
    t = greet.last_trace
    assert (t.query, t.model, t.inputs, t.sample) == ("greet", "tiny-llama", {"who": "Ada"}, 0)
    page = t.to_html()
    assert "<title>kvql trace: greet on tiny-llama</title>" in page
    assert "who = Ada" in page and t.created[:4] in page and t.created[:2] == "20"


def test_save_all_writes_one_section_per_sample(m, tmp_path):
    q = kvql.query('''sample(n=3, temperature=1.0)
"Say: [X]" where len(TOKENS(X)) < 4''', is_async=False)
    q(model=m)
    assert len(q.last_traces) == 3 and [t.sample for t in q.last_traces] == [0, 1, 2]
    save_all(q.last_traces, tmp_path / "t.html")
    save_all(q.last_traces, tmp_path / "t.json")
    page = (tmp_path / "t.html").read_text()
    assert page.count('<section class="sample"') == 3
    assert all(f"Sample {k} of 3" in page for k in (1, 2, 3))
    assert page.count("[X] where len(TOKENS(X)) &lt; 4") == 1  # the where clause once, in the header
    data = json.loads((tmp_path / "t.json").read_text())
    assert [d["summary"] for d in data["traces"]] == [t.summary() for t in q.last_traces]


def test_a_trace_built_by_hand_renders_with_defaults():
    t = Trace([TraceToken(1, "a", "computed", None), TraceToken(2, "b", "unsent", "X")],
              [TraceHole("X", "b", "", 1, 0.1)])
    page = t.to_html()
    assert "kvql trace: query on a model" in page and "[X] (no where clause)" in page
    assert t.counts()["all"] == {"cached": 0, "computed": 1, "unsent": 1, "total": 2}


FORCING = '''
"Name a colour: [C]" where C in ["ultramarine blue", "ultraviolet"]
'''


def test_forced_tokens_are_shown_apart_and_match_the_engines(m, tmp_path):
    """Tokens jump-forward appended (the constraint allowed only them) are marked forced in the trace, as many
    as the engine counted; without jump-forward the same value comes with none forced."""
    before = m.stats()["forced_tokens"]
    r = kvql.run_sync(FORCING, model=m)
    t = r.trace
    forced = [x for x in t.tokens if x.forced]
    assert forced and all(x.hole == "C" for x in forced)
    assert len(forced) == t.holes[0].forced == t.summary()["forced"]
    assert m.stats()["forced_tokens"] - before == len(forced) + 1  # and the EOS that ended the value
    assert len(forced) < t.holes[0].tokens  # the tokens that chose between the options were decoded
    r.trace.save(tmp_path / "t.html")
    page = (tmp_path / "t.html").read_text()
    assert page.count(' gen forced"') == len(forced)
    assert f"({len(forced)} forced)" in page

    m.engine.jump_forward = False
    try:
        m.clear_cache()
        plain = kvql.run_sync(FORCING, model=m)
    finally:
        m.engine.jump_forward = True
    assert plain.variables["C"] == r.variables["C"]
    assert [x.id for x in plain.trace.tokens] == [x.id for x in t.tokens]
    assert not any(x.forced for x in plain.trace.tokens) and plain.trace.holes[0].forced == 0


def test_completion_forced_indexes_its_token_ids(m):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    [c] = m.generate("JSON:", max_tokens=20, json_schema=schema)
    assert c.forced and all(0 <= i < len(c.token_ids) for i in c.forced)
    assert c.text.startswith('{"ok": ')
    m.engine.jump_forward = False
    try:
        m.clear_cache()
        [plain] = m.generate("JSON:", max_tokens=20, json_schema=schema)
    finally:
        m.engine.jump_forward = True
    assert plain.token_ids == c.token_ids and plain.forced == []


TWO_HOLES = '"Q: Name a color.\\nA:[A]" where len(TOKENS(A)) < 4\n"\\nQ: Name a fruit.\\nA:[B]" where len(TOKENS(B)) < 4'


def test_a_cold_runs_summary_counts_what_every_request_took_from_the_cache(m):
    r = kvql.run_sync(TWO_HOLES, model=m)
    s = r.trace.summary()
    # [B]'s request sent [A]'s prompt and value again and the engine served them from its cache
    assert s["requests"] == 2 and s["request_cached"] == r.cached_tokens > s["cached"]
    assert s["request_tokens"] == r.cached_tokens + r.computed_tokens
    assert s["hit_rate"] == pytest.approx(r.cached_tokens / s["request_tokens"])
    page = r.trace.to_html()
    assert f"2 requests sent {s['request_tokens']} prompt tokens, {s['request_cached']} of them from the cache" in page


def test_special_tokens_show_as_labels_not_raw_template_text(m):
    t = kvql.run_sync('"Say [A]" where len(TOKENS(A)) < 3', model=m).trace
    t.tokens[0].special, t.tokens[0].text = True, "<|im_start|>"
    page = t.to_html()
    assert "⟨im_start⟩" in page and "&lt;|im_start|&gt;</span>" not in page
    assert 'class="tok computed special"' in page or 'class="tok cached special"' in page


def test_a_healed_holes_row_counts_the_tokens_the_trace_marks_as_generated(m):
    r = kvql.run_sync('"Answer: yes or no? A: "\n"[A]" where HEAL(A) and A in ["yes", "no"]', model=m)
    t = r.trace
    (row,) = t.holes
    assert row.tokens == t.summary()["generated"] == sum(1 for x in t.tokens if x.hole == "A")
    assert row.healed >= 1 and "backed-up prompt token" in t.to_html()


def test_a_hole_row_says_how_long_its_checks_before_the_request_took():
    hole = TraceHole("A", "x", "", 1, 1.5, setup_seconds=1.2)
    page = Trace([TraceToken(5, "x", "computed", "A")], [hole]).to_html()
    assert "before the request: 1.200 s, checks and compiling its constraint" in page
    quick = Trace([TraceToken(5, "x", "computed", "A")], [TraceHole("A", "x", "", 1, 0.01, setup_seconds=0.001)])
    assert "before the request" not in quick.to_html()


def test_a_holes_time_before_its_request_includes_the_backends_constraint_compile(m):
    # the compile of a constraint happens in the backend, after the runtime's checks: it reports it
    (c,) = m.generate(["Q: a number?\nA:"], max_tokens=3, regex=r" [0-9]{1,2}")
    assert c.prepare_seconds > 0
    r = kvql.run_sync('"Q: a number?\\nA:[N]" where REGEX(N, r" [0-9]{1,3}")', model=m)
    (row,) = r.trace.holes
    assert 0 < row.setup_seconds <= row.seconds
