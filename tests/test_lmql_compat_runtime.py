"""LMQL 0.7.3 compatibility of the query runtime: `or` over stop conditions, type constraints,
conditions on nested-query holes, decoder options and decoders, chat roles in `result.prompt`.

Each test is one behaviour that LMQL's tests or documentation specify, on the tiny random Llama of
conftest.py: the text is gibberish, so the tests compare with a reference run of the same model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest

import kvql
import kvql as lmql
from kvql.runtime.json_types import type_schema


@pytest.fixture
def m(each_backend):
    """Each test runs on the local engine and through the remote backend on `kvql serve`."""
    return each_backend

PROMPT = "Once upon a time"


def greedy(where: str = "len(TOKENS(X)) < 40", **options) -> str:
    """X of `PROMPT[X]` under `where`, greedy unless options say otherwise."""
    return lmql.run_sync(f'"{PROMPT}[X]" where {where}', **options).variables["X"]


def first_at(text: str, *phrases: str) -> str:
    """`text` up to and including the earliest of `phrases` (all of it if none occurs)."""
    hits = [(text.find(p), p) for p in phrases if p in text]
    if not hits:
        return text
    i, p = min(hits)
    return text[:i + len(p)]


def greedy_tokens(where: str, **options) -> tuple[str, int]:
    """(X, how many tokens the model generated for it): the text alone may re-tokenize differently."""
    q = lmql.query(f'"{PROMPT}[X]" where {where}', is_async=False)
    x = q(**options).variables["X"]
    return x, q.last_trace.holes[0].tokens


@dataclass
class Point:
    x: int
    y: int


@dataclass
class Segment:
    start: Point
    end: Point
    closed: bool


# -- or over stop phrases and token bounds (test_stopping.py, test_orop.py) -------------------------
def test_or_of_stop_phrases_ends_the_value_at_whichever_comes_first(m):
    full = greedy()
    a, b = full.strip()[1], full.strip()[3]  # two characters the model does write
    assert greedy(f"STOPS_AT(X, {a!r}) or STOPS_AT(X, {b!r})") == first_at(full, a, b)


def test_stop_phrase_in_an_or_fires_whatever_the_token_bound(m):
    full = greedy()
    c = full.strip()[2]
    assert greedy(f"len(TOKENS(X)) > 30 or STOPS_AT(X, {c!r})") == first_at(full, c)


def test_token_bound_in_an_or_with_a_stop_phrase_neither_caps_nor_ends_the_value(m):
    # STOPS_AT is always true as a condition in LMQL, so the `or` holds for every value
    unbounded = greedy("len(TOKENS(X)) < 100", max_len=24)
    value, n = greedy_tokens('STOPS_AT(X, "QQQ") or len(TOKENS(X)) < 3', max_len=24)
    assert value == unbounded and n > 3
    assert greedy('STOPS_AT(X, "QQQ") or len(TOKENS(X)) > 5', max_len=24) == unbounded


def test_or_of_token_upper_bounds_allows_the_loosest(m):
    value, n = greedy_tokens("len(TOKENS(X)) < 3 or len(TOKENS(X)) < 7")
    assert greedy().startswith(value) and n == 6


def test_or_joining_a_stop_phrase_with_another_kind_of_condition_raises_naming_it(m):
    with pytest.raises(kvql.QueryError, match=r"STOPS_AT\(X, '\.'\) or X == 'a'"):
        greedy('STOPS_AT(X, ".") or X == "a"')


def test_global_where_with_and_next_to_an_inline_where_is_one_conjunction(m):
    q = lmql.query('"A[X]" where len(TOKENS(X)) < 4\n"B[Y]" where Y in ["yes", "no"]\n'
                   'where len(TOKENS(X)) < 3 and len(TOKENS(Y)) < 9', is_async=False)
    r = q()
    assert q.last_trace.holes[0].tokens == 2 and r.variables["Y"] in ("yes", "no")


# -- type constraints (release 0.7 notes: `where type(X) is Person`) --------------------------------
def test_type_schema_of_a_dataclass_lists_its_fields_in_order_all_required():
    schema = type_schema(Segment)
    assert list(schema["properties"]) == ["start", "end", "closed"]
    assert schema["required"] == ["start", "end", "closed"] and schema["additionalProperties"] is False
    assert schema["properties"]["start"]["properties"]["x"] == {"type": "integer"}
    assert type_schema(list[float]) == {"type": "array", "items": {"type": "number"}}


def test_type_constraint_gives_an_instance_of_the_dataclass(m):
    r = lmql.run_sync('"A point: [P]" where type(P) is Point')
    p = r.variables["P"]
    assert isinstance(p, Point) and isinstance(p.x, int) and isinstance(p.y, int)


def test_type_constraint_parses_nested_dataclasses(m):
    s = lmql.run_sync('"A segment: [S]" where type(S) is Segment').variables["S"]
    assert isinstance(s, Segment) and isinstance(s.start, Point) and isinstance(s.closed, bool)


def test_type_constrained_value_stays_in_the_prompt_as_the_json_the_model_wrote(m):
    r = lmql.run_sync('"A point: [P]" where type(P) is Point')
    p = r.variables["P"]
    assert r.prompt == f'A point: {{"x": {p.x}, "y": {p.y}}}'


def test_dataclass_typed_hole_is_a_type_constraint(m):
    r = lmql.run_sync('"A point: [P: Point]"')
    assert r.variables["P"] == lmql.run_sync('"A point: [P]" where type(P) is Point').variables["P"]


def test_type_constraint_with_an_unsupported_field_type_raises_naming_it(m):
    @dataclass
    class Bad:
        tags: dict

    with pytest.raises(ValueError, match=r"Bad\.tags: type dict is not supported"):
        lmql.run_sync('"[B]" where type(B) is Bad')


def test_type_constraint_with_a_regex_condition_on_the_same_hole_raises_naming_both(m):
    with pytest.raises(kvql.QueryError, match=r"type\(P\) is Point and REGEX"):
        lmql.run_sync('"[P]" where type(P) is Point and REGEX(P, "[a-z]+")')


# -- conditions on a nested query's hole (test_nested_queries.py) -----------------------------------
@lmql.query
def hello():
    '''lmql
    "Say: [W]" where W in ["hello world"]
    return W
    '''


def test_condition_on_a_nested_query_hole_holds_for_its_value(m):
    r = lmql.run_sync('"Q: [A: hello]" where len(TOKENS(A)) < 20 and A in ["hello world"]')
    assert r.variables["A"] == "hello world" and r.prompt == "Q: hello world"


def test_condition_on_a_nested_query_hole_that_its_value_breaks_raises(m):
    with pytest.raises(kvql.UnmetConstraint, match=r"len\(TOKENS\(A\)\) < 2"):
        lmql.run_sync('"Q: [A: hello]" where len(TOKENS(A)) < 2')


def test_condition_on_a_called_nested_query_hole_is_checked_too(m):
    @lmql.query
    def say(w):
        '''lmql
        "Say: [W]" where W in [w]
        return W
        '''

    with pytest.raises(kvql.UnmetConstraint, match="A in"):
        lmql.run_sync('"Q: [A: say(\'yes\')]" where A in ["no"]')


def test_stop_phrase_on_a_nested_query_hole_raises_naming_it(m):
    with pytest.raises(kvql.QueryError, match=r"STOPS_AT\(A, '\.'\)"):
        lmql.run_sync('"Q: [A: hello]" where STOPS_AT(A, ".")')


# -- decoder options (decoding.md: additional decoding and runtime parameters) ----------------------
def test_top_k_of_one_samples_the_greedy_value(m):
    assert greedy(decoder="sample", top_k=1, temperature=1.5, seed=3) == greedy()


def test_top_k_limits_sampling_to_the_k_most_likely_tokens(m):
    kvql_values = {greedy("len(TOKENS(X)) < 2", decoder="sample", top_k=2, seed=s) for s in range(12)}
    assert 1 <= len(kvql_values) <= 2


def test_repetition_penalty_of_one_keeps_greedy_output_exact(m):
    assert greedy(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0) == greedy()


def test_repetition_penalty_changes_greedy_output(m):
    assert greedy(repetition_penalty=50.0) != greedy()


def test_min_p_of_one_keeps_only_the_most_likely_token(m):
    assert greedy(decoder="sample", min_p=1.0, temperature=1.5, seed=3) == greedy()


def test_invalid_sampling_option_is_refused_at_definition(m):
    with pytest.raises(ValueError, match="top_k"):
        lmql.query('"[X]"', top_k=-1)
    with pytest.raises(ValueError, match="repetition_penalty"):
        lmql.query('"[X]"', repetition_penalty=0)
    with pytest.raises(ValueError, match="min_p"):
        lmql.query('"[X]"', min_p=1.5)


def test_openai_and_cache_options_are_accepted_without_effect(m):
    assert greedy(chunksize=30, verbose=False, cache=True, openai_chunksize=64, chunk_timeout=2.5) == greedy()


def test_an_option_no_decoder_knows_is_ignored_with_a_warning(m):
    # LMQL hands options it does not know to its model backend, which ignores them (`beams=2`)
    with pytest.warns(UserWarning, match=r"ignores the option\(s\) \['frobnicate'\]"):
        q = lmql.query(f'"{PROMPT}[X]" where len(TOKENS(X)) < 3\nreturn X', frobnicate=1, is_async=False)
    with pytest.warns(UserWarning, match="frobnicate"):
        assert q() == greedy("len(TOKENS(X)) < 3")


# -- decoders (decoding.md: beam_sample, var, beam_var; dclib: best_k) ------------------------------
def test_beam_sample_in_the_query_gives_n_results(m):
    rs = lmql.run_sync(f'beam_sample(n=3, temperature=0.8)\n"{PROMPT}[X]" where len(TOKENS(X)) < 4', seed=1)
    assert isinstance(rs, list) and len(rs) == 3 and all(isinstance(r, kvql.LMQLResult) for r in rs)


def test_beam_sample_with_a_seed_is_reproducible(m):
    q = f'beam_sample(n=2)\n"{PROMPT}[X]" where len(TOKENS(X)) < 4'
    assert [r.variables["X"] for r in lmql.run_sync(q, seed=5)] == [r.variables["X"] for r in lmql.run_sync(q, seed=5)]


def test_beam_var_runs_as_beam_search(m):
    q = '"{}[X]" where len(TOKENS(X)) < 4'.format(PROMPT)
    beam = [r.variables["X"] for r in lmql.run_sync(q, decoder="beam", n=2)]
    assert [r.variables["X"] for r in lmql.run_sync(q, decoder="beam_var", n=2)] == beam


def test_best_k_gives_k_results_as_a_beam_of_width_k(m):
    q = '"{}[X]" where len(TOKENS(X)) < 4'.format(PROMPT)
    beam = [r.variables["X"] for r in lmql.run_sync(q, decoder="beam", n=3)]
    assert [r.variables["X"] for r in lmql.run_sync(q, decoder="best_k", k=3)] == beam


def test_var_gives_b_results(m):
    rs = lmql.run_sync(f'var(b=2)\n"{PROMPT}[X]" where len(TOKENS(X)) < 4', seed=2)
    assert isinstance(rs, list) and len(rs) == 2


def test_unknown_decoder_raises_value_error_naming_the_known_ones(m):
    with pytest.raises(ValueError, match="beam_sample"):
        greedy(decoder="nucleus")


# -- chat (docs/lib/chat): roles in result.prompt ---------------------------------------------------
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}")


@pytest.fixture
def chat(llama, tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    model = kvql.Model(llama, tok, cache_budget="8MB")
    yield model
    model.close()


def test_result_prompt_shows_roles_as_lmql_tags(chat):
    r = lmql.run_sync('"{:system}Be brief.{:user}Say hi.{:assistant}[A]" where len(TOKENS(A)) < 3', model=chat)
    assert r.prompt == "<lmql:system/>Be brief.<lmql:user/>Say hi.<lmql:assistant/>" + r.variables["A"]


def test_model_sees_roles_through_its_chat_template(chat):
    q = lmql.query('"{:user}Say hi.{:assistant}[A]" where len(TOKENS(A)) < 3', is_async=False, model=chat)
    q()
    seen = "".join(t.text for t in q.last_trace.tokens)
    assert seen.startswith("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n")
