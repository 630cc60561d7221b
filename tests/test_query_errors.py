"""Queries whose constraints cannot be met, and query errors in the user's terms.

A hole's value is returned only if it meets its whole where clause. When the token cap, max_len or a
stop phrase ends the value before its constraint is met, or when the conditions contradict each
other, the run raises `UnmetConstraint` (a `kvql.QueryError` and a `ValueError`) naming the hole and
the conflict; where that is certain before generating, nothing is generated. Syntax errors point at
the line and column of the query where the problem is.

The model is the tiny random Llama of conftest.py (and its 400-token vocabulary), so the values are
gibberish: the tests check which values may come back, never their meaning.
"""

from __future__ import annotations

import re

import pytest

import kvql
import kvql as lmql
from kvql.backends.remote import RemoteBackend
from kvql.completion import Completion
from kvql.runtime.errors import UnmetConstraint


@pytest.fixture
def m(each_backend):
    """Each test runs on the local engine and through the remote backend on `kvql serve`."""
    return each_backend


def generated(m) -> int:
    return m.stats()["generated_tokens"]


def unmet(src: str, **kw) -> UnmetConstraint:
    with pytest.raises(UnmetConstraint) as info:
        lmql.run_sync(src, **kw)
    return info.value


# -- item 3: no value that breaks its where clause -----------------------------------------------
def test_choices_that_need_more_tokens_than_the_cap_are_refused_before_generating(m, tokenizer):
    choices = ["Volleyball", "Sunscreen"]
    assert min(len(tokenizer.encode(c)) for c in choices) > 2
    before = generated(m)
    err = unmet(f'"Pick: [X]" where X in {choices!r} and len(TOKENS(X)) < 3')
    assert generated(m) == before
    assert err.hole == "X" and err.value is None
    assert isinstance(err, kvql.QueryError) and isinstance(err, ValueError)
    assert str(err).startswith("hole X: ")
    assert "X in ['Volleyball', 'Sunscreen']" in str(err) and "len(TOKENS(X)) < 3" in str(err)


def test_a_choice_cut_short_by_the_token_cap_is_an_error_not_a_value(m):
    # "a" fits in the cap, so generating is allowed; the model prefers the long choice
    src = '"Pick: [X]" where X in ["Volleyball", "a"] and len(TOKENS(X)) < 3'
    errors = []
    for seed in range(4):
        try:
            r = lmql.run_sync("sample\n" + src, seed=seed)
        except UnmetConstraint as e:
            errors.append(e)
        else:
            assert r.variables["X"] in ("Volleyball", "a")
    assert errors
    for e in errors:
        assert e.value and "Volleyball".startswith(e.value) and e.value != "Volleyball"
        assert f"the value {e.value!r} is incomplete" in str(e)
        assert "X in ['Volleyball', 'a']" in str(e) and "2 tokens that len(TOKENS(X)) < 3 allows" in str(e)


def test_a_regex_cut_short_by_the_token_cap_is_an_error(m):
    err = unmet('"Date: [D]" where REGEX(D, r"[0-9]{4}-[0-9]{2}-[0-9]{2}") and len(TOKENS(D)) < 4')
    assert err.hole == "D" and err.value is not None
    assert not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", err.value)
    assert "REGEX(D, '[0-9]{4}-[0-9]{2}-[0-9]{2}')" in str(err) and "len(TOKENS(D)) < 4" in str(err)


def test_a_length_no_cap_of_tokens_can_hold_is_refused_before_generating(m):
    before = generated(m)
    err = unmet('"Say: [X]" where len(X) > 60 and len(TOKENS(X)) < 3')
    assert generated(m) == before
    assert "len(X) > 60" in str(err) and "len(TOKENS(X)) < 3" in str(err)


def test_a_value_cut_short_by_max_len_is_an_error(m):
    err = unmet('"Say: [X]" where REGEX(X, "[a-z]{4}")', max_len=6)
    assert err.value is not None and len(err.value) < 4
    assert "max_len=6" in str(err)


def test_a_token_lower_bound_above_max_len_is_refused_before_generating(m):
    before = generated(m)
    err = unmet('"Say: [X]" where len(TOKENS(X)) > 5', max_len=6)
    assert generated(m) == before
    assert "len(TOKENS(X)) > 5" in str(err) and "max_len=6" in str(err)


def test_a_value_cut_short_by_its_stop_phrase_is_the_value_up_to_it(m):
    # LMQL's rule: a stop phrase ends the value wherever it appears, even inside a value its grammar continues
    x = lmql.run_sync('"Story:[X]" where STOPS_AT(X, " ") and REGEX(X, "[a-z]+ [a-z]+")').variables["X"]
    assert re.fullmatch("[a-z]+ ", x)


def test_beam_search_returns_no_incomplete_value_either(m):
    # (servers return no log-probabilities of a constrained distribution: there it is refused by name)
    with pytest.raises(lmql.QueryError, match="hole X|X: beam search under a constraint .* not available"):
        lmql.run_sync('beam(n=2)\n"Pick: [X]" where X in ["Volleyball", "a"] and len(TOKENS(X)) < 3')


def test_values_that_meet_their_constraints_still_come_back(m):
    r = lmql.run_sync('"Pick: [X] [Y] [Z]" where X in ["Volleyball", "a"] and len(TOKENS(X)) < 12 '
                      'and REGEX(Y, "[a-z]{2}") and len(TOKENS(Y)) < 3 and INT(Z) and len(TOKENS(Z)) < 3')
    assert r.variables["X"] in ("Volleyball", "a")
    assert re.fullmatch("[a-z]{2}", r.variables["Y"]) and isinstance(r.variables["Z"], int)


class FakeServer(RemoteBackend):
    """A remote model that answers every request with one fixed completion (no HTTP)."""

    def __init__(self, text: str, finish_reason: str = "stop", stop_reason: str | None = None):
        self.name, self.kind, self.base_url = "fake", "kvql", "http://fake/v1"
        self.completion = Completion(text, [], finish_reason, 1, 0, stop_reason=stop_reason)
        self.requests: list[dict] = []

    async def agenerate(self, prompts, **options):
        self.requests.append(options)
        return [self.completion]


def test_remote_value_that_breaks_the_regex_is_an_error(m):
    server = FakeServer("2024-1", finish_reason="length")
    with pytest.raises(UnmetConstraint, match=r"the value '2024-1' is incomplete.*REGEX\(D"):
        lmql.run_sync('"Date: [D]" where REGEX(D, r"[0-9]{4}-[0-9]{2}") and len(TOKENS(D)) < 4', model=server)
    assert server.requests[0]["regex"] == "[0-9]{4}-[0-9]{2}"
    with pytest.raises(UnmetConstraint, match="does not satisfy"):  # a server that ignored the regex
        lmql.run_sync('"Pick: [X]" where X in ["yes", "no"]', model=FakeServer("maybe"))
    r = lmql.run_sync('"Date: [D]" where REGEX(D, r"[0-9]{4}-[0-9]{2}")', model=FakeServer("2024-11"))
    assert r.variables["D"] == "2024-11"


def test_remote_stop_phrase_counts_toward_the_regex_as_locally(m):
    src = '"Say: [X]" where STOPS_BEFORE(X, ".") and REGEX(X, r"[a-z]+\\.")'
    r = lmql.run_sync(src, model=FakeServer("abc", stop_reason="."))
    assert r.variables["X"] == "abc"


# -- item 9: errors in the user's terms ----------------------------------------------------------
def test_contradictory_choices_say_so(m):
    before = generated(m)
    err = unmet('"Say: [X]" where X in ["a"] and X in ["b"]')
    assert str(err) == "hole X: its constraints cannot all hold: X in ['a'] and X in ['b']"
    assert "NoExtensionBias" not in str(err) and generated(m) == before


def test_contradictory_regexes_say_so(m):
    err = unmet('"Say: [X]" where REGEX(X, "[0-9]+") and X.startswith("a")')
    assert str(err) == "hole X: its constraints cannot all hold: REGEX(X, '[0-9]+') and X.startswith('a')"


def test_a_constraint_that_can_never_hold_says_so(m):
    err = unmet('"Say: [X]" where len(X) < 3 and len(X) > 5 or X == "" and X == "a"')
    assert str(err) == ("hole X: its constraint can never hold: "
                        "(len(X) < 3 and len(X) > 5) or (X == '' and X == 'a')")


def test_the_empty_string_is_a_value_a_constraint_may_name(m):
    assert lmql.run_sync('"Say: [X]|" where X == "" or X == "ok"').variables["X"] in ("", "ok")


def test_contradictory_token_bounds_name_both(m):
    with pytest.raises(kvql.QueryError, match=r"len\(TOKENS\(X\)\) > 5 and len\(TOKENS\(X\)\) < 3"):
        lmql.run_sync('"Say: [X]" where len(TOKENS(X)) > 5 and len(TOKENS(X)) < 3')


def test_a_token_lower_bound_no_choice_can_reach_is_refused_before_generating(m):
    before = generated(m)
    err = unmet('"Say: [X]" where X in ["a", "b"] and len(TOKENS(X)) > 3')
    assert generated(m) == before
    assert "len(TOKENS(X)) > 3" in str(err) and "X in ['a', 'b']" in str(err)


def test_a_value_that_runs_into_a_dead_end_names_its_constraints(m):
    err = unmet('"Say: [X]" where len(X) < 3 and len(TOKENS(X)) > 5')
    # locally no token can continue; a server ends the value when the grammar is complete: both name both
    assert str(err).startswith("hole X: ") and "len(X) < 3" in str(err) and "len(TOKENS(X)) > 5" in str(err)


def test_an_invalid_regex_is_named_by_its_condition(m):
    """A literal regex is checked where the query is defined, at its line and column (no model needed); one
    that is a variable's value, when the hole runs."""
    src = '"Say: [X]" where len(TOKENS(X)) < 3 and REGEX(X, "[")'
    with pytest.raises(kvql.QuerySyntaxError, match=r"REGEX\(X, '\['\): invalid regex: unclosed character class"):
        lmql.query(src)
    assert position(src)[:2] == (1, src.index('"["') + 1)
    pattern = "["
    with pytest.raises(ValueError, match=r"REGEX\(X, '\['\): invalid constraint"):
        lmql.run_sync('"Say: [X]" where len(TOKENS(X)) < 3 and REGEX(X, pattern)')


@pytest.mark.parametrize("fn", ["STOPS_AT", "STOPS_BEFORE"])
def test_an_empty_stop_phrase_is_an_error_naming_it(m, fn):
    src = f'"Hi [X]" where len(TOKENS(X)) < 3 and {fn}(X, "")'
    with pytest.raises(kvql.QuerySyntaxError, match=f'{fn}\\(X, ""\\)') as info:
        lmql.query(src)
    assert (info.value.lineno, info.value.offset) == (1, src.index('""') + 1)
    empty = ""
    with pytest.raises(ValueError, match=f'{fn}\\(X, ""\\): the stop phrase is empty'):
        lmql.run_sync(f'"Hi [X]" where {fn}(X, empty)')


def position(src: str) -> tuple[int, int, str]:
    """(line, column, message) of the QuerySyntaxError that compiling `src` raises."""
    with pytest.raises(kvql.QuerySyntaxError) as info:
        lmql.query(src)
    return info.value.lineno, info.value.offset, info.value.msg_only


def test_unclosed_bracket_points_at_the_bracket(m):
    assert position('x = (1,\n     2\n"Hi [X]" where len(TOKENS(X)) < 3\n')[:2] == (1, 5)
    line, col, msg = position('"Hi [X]" where (len(TOKENS(X)) < 3\ny = 1\n')
    assert (line, col) == (1, 16) and "'(' was never closed" in msg


def test_mismatched_bracket_points_at_the_closing_one(m):
    line, col, msg = position('"Hi [X]" where (len(TOKENS(X)) < 3 and\n    X in ["a"] and ])\n')
    assert (line, col) == (2, 20) and "does not match" in msg


def test_unterminated_strings_point_at_their_start(m):
    assert position('x = 1\ny = "abc\n"Hi [X]" where X in ["a"]\n')[:2] == (2, 5)
    assert position('x = 1\n"""Hello [X]\ny = 2\n')[:2] == (2, 1)
    assert position('"Hi [X]" where X in ["a", "b]\n')[:2] == (1, 27)


def test_errors_in_a_multi_line_where_are_on_their_own_line(m):
    line, col, msg = position('"Hi [X]" where (len(TOKENS(X)) < 3 and\n'
                              '    X in ["a"] and and True)\n')
    assert (line, col) == (2, 20)
    line, col, msg = position('"Hi [X]" where (len(TOKENS(X)) < 3 and\n    FOO(X))\n')
    assert (line, col) == (2, 5) and "FOO" in msg
    line, col, msg = position('"Hi [X]" where len(TOKENS(X)) < 3 and \\\n  STOPS_AT(Y, ".")\n')
    assert (line, col) == (2, 12) and "Y" in msg


def test_standalone_where_may_span_lines_and_its_errors_keep_their_line(m):
    src = 'argmax\n    "Hi [X]"\nwhere\n    len(TOKENS(X)) < 3 and\n    X in ["a", "b"]\n'
    assert lmql.run_sync(src).variables["X"] in ("a", "b")
    assert position('argmax\n    "Hi [X]"\nwhere\n    len(TOKENS(X)) < 3 and\n    X in ["a"] +* 2\n')[:2] == (5, 17)
    assert position('argmax\n    "Hi [X]"\nwhere\n    len(TOKENS(X)) < 3 and\n    X in ["a", "b"\n')[:2] == (5, 10)


def test_bad_conversion_in_a_prompt_string_points_within_the_line(m):
    line, col, msg = position('x = 1\n"Hi {x!z} [X]" where len(TOKENS(X)) < 3\n')
    assert (line, col) == (2, 7) and "'!z'" in msg
    # escapes and triple quotes before it: the column is the one in the query text
    assert position('"a\\nb\\tc {x!q} [X]" where X in ["a"]\n')[:2] == (1, 12)
    assert position('x = 1\n"""first\n  second {x!q} [X]""" where X in ["a"]\n')[:2] == (3, 12)
    assert position('if True:\n    "indented {x!q}"\n')[:2] == (2, 17)


def test_errors_inside_a_prompt_string_point_at_them(m):
    assert position('x = 1\n"Hi {x +* 2} [X]" where len(TOKENS(X)) < 3\n')[:2] == (2, 9)
    assert position('"ok [X]" where X in ["a"]\n"Hello {name"')[:2] == (2, 8)
    assert position('"ok" "more [X: int int]" where len(TOKENS(X)) < 3\n')[:2] == (1, 16)
