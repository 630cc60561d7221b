"""LMQL 0.7.3 query syntax that must run unchanged: each test is one behaviour LMQL's documentation
or tests specify (clause layouts, helpers defined in a query, prompt-string details, where clauses,
model clauses).

The model is the tiny random Llama of conftest.py: the tests check structure, never meaning.
"""

from __future__ import annotations

import re

import pytest

import kvql
import kvql as lmql


@pytest.fixture
def m(each_backend):
    """Each test runs on the local engine and through the remote backend on `kvql serve`."""
    return each_backend

PREFIX_SEEN: list = []


# -- functions and classes defined inside a query ------------------------------------------------
def test_a_decorator_defined_in_the_query_body_is_plain_python(m):
    r = lmql.run_sync('''
def shout(value):
    "Upper-cases a value (this string is the function's docstring, not a prompt)."
    return value.upper()

"Say 'this is a test':[@shout TEST]" where len(TOKENS(TEST)) < 4
''')
    assert r.variables["TEST"] == r.variables["TEST"].upper()
    assert r.prompt == "Say 'this is a test':" + r.variables["TEST"]


def test_a_query_without_return_still_returns_its_result_when_a_helper_returns(m):
    r = lmql.run_sync('''
def helper(s):
    return s.strip()

"Q: [A]" where len(TOKENS(A)) < 3
''')
    assert isinstance(r, kvql.LMQLResult) and r.prompt.startswith("Q: ")


def test_a_return_inside_a_helper_returns_from_the_helper_only(m):
    out = lmql.run_sync('''
def helper(s):
    return "helper:" + s

"Q: [A]" where len(TOKENS(A)) < 3
return helper(A)
''')
    assert isinstance(out, str) and out.startswith("helper:")


def test_a_nested_query_defined_inside_a_query_runs_as_a_nested_query(m):
    @lmql.query
    def outer():
        '''lmql
        @lmql.query
        def inner():
            """lmql
            "A: Let's think step by step. [ANSWER]" where len(TOKENS(ANSWER)) < 3
            return ANSWER.strip()
            """

        "Q: What is 2+2? [ANSWER: inner]"
        return ANSWER
        '''

    out = outer()
    assert isinstance(out, str)
    assert outer.last_trace is not None


def test_a_class_defined_in_the_query_body_keeps_its_strings(m):
    r = lmql.run_sync('''
class Note:
    "A docstring, not a prompt."
    text = "a class attribute, not a prompt"

"Hello[X]" where len(TOKENS(X)) < 2
''')
    assert r.prompt == "Hello" + r.variables["X"]


def test_an_async_helper_defined_in_the_query_can_be_awaited(m):
    out = lmql.run_sync('''
async def twice(s):
    "not a prompt"
    return s + s

"Hi[X]" where len(TOKENS(X)) < 2
return await twice(X)
''')
    assert isinstance(out, str)


# -- clause layouts ------------------------------------------------------------------------------
def test_one_line_standalone_query(m):
    r = lmql.run_sync('argmax "Hello[WHO]" where len(TOKENS(WHO)) < 4 from "tiny"', model=m)
    assert r.prompt == "Hello" + r.variables["WHO"]
    assert len(m.tokenizer.encode(r.variables["WHO"])) < 4


def test_one_line_standalone_query_with_from_before_where(m):
    r = lmql.run_sync('argmax "Hello[WHO]" from "tiny" where WHO in ["a", "b"]', model=m)
    assert r.variables["WHO"] in ("a", "b")


def test_where_continued_with_a_backslash_on_an_indented_line(m):
    r = lmql.run_sync('argmax "What is the capital of France? [ANSWER]" \\\n'
                      '    where ANSWER in ["Paris", "Rome"]')
    assert r.variables["ANSWER"] in ("Paris", "Rome")
    r = lmql.run_sync('argmax\n    "Pick: [X]"\nwhere \\\n    X in ["a", "b"]\n')
    assert r.variables["X"] in ("a", "b")


def test_multi_line_standalone_where_with_and_at_line_ends(m):
    r = lmql.run_sync('argmax\n'
                      '    "Pick: [X] and [Y]"\n'
                      'where\n'
                      '    X in ["a", "b"] and\n'
                      '    len(TOKENS(Y)) < 3 and\n'
                      '    STOPS_AT(Y, ".")\n')
    assert r.variables["X"] in ("a", "b")
    assert len(m.tokenizer.encode(r.variables["Y"])) < 3


def test_distribution_clause_continued_with_a_backslash(m):
    r = lmql.run_sync('argmax "Is the sky blue? [ANSWER]" \\\n    distribution ANSWER in ["yes", "no"]')
    assert r.variables["ANSWER"] in ("yes", "no")
    r = lmql.run_sync('argmax\n    "Is the sky blue? [ANSWER]"\ndistribution \\\n    ANSWER in ["yes", "no"]\n')
    assert r.variables["ANSWER"] in ("yes", "no")


def test_python_statements_before_the_decoder_are_globals_of_the_query(m):
    @lmql.query
    def q(actual_input: str = "x"):
        '''lmql
        a = 12

        def f(): return 13

        class A: pass

        argmax
            "Q: Hi {actual_input} {a} {f()}[X]" where len(TOKENS(X)) < 2
            for name in ["A", "a", "f"]:
                assert name not in locals() and name in globals(), name
            assert "actual_input" in locals() and "actual_input" not in globals()
        from
            "tiny"
        '''

    r = q(model=m)
    assert r.prompt.startswith("Q: Hi x 12 13")


def test_decoder_arguments_may_be_expressions_over_the_inputs(m):
    out = lmql.run_sync('sample(n=count, temperature=t)\n"Once[X]" where len(TOKENS(X)) < 3\nreturn X', count=2, t=0.7)
    assert isinstance(out, list) and len(out) == 2
    r = lmql.run_sync('argmax(max_len=limit)\n    "Q: Hi {limit}. A: [WHO]"\n    assert "limit" in locals()\n'
                      'from\n    "tiny"\nwhere\n    len(TOKENS(WHO)) < 3\n', limit=64, model=m)
    assert r.prompt.startswith("Q: Hi 64. A: ")


def test_comment_lines_before_the_decoder_and_before_the_model_name(m):
    r = lmql.run_sync('# first comment\n'
                      '# second comment\n'
                      'argmax\n'
                      '    # a comment in the body\n'
                      '    "Hello[X]"\n'
                      'from\n'
                      '    # which model\n'
                      '    "tiny"\n'
                      'where\n'
                      '    # the constraint\n'
                      '    len(TOKENS(X)) < 2\n', model=m)
    assert r.prompt == "Hello" + r.variables["X"]


def test_output_variables_of_a_one_line_standalone_query(m):
    @lmql.query
    async def q():
        '''lmql
        argmax "Q: Hi. A: [WHO]" from "tiny" where len(TOKENS(WHO)) < 10
        '''

    assert q.output_variables == ["WHO"]


def test_a_decoder_name_used_as_a_variable_is_not_a_decoder_clause(m):
    out = lmql.run_sync('sample = "chosen"\n"Hi {sample}[X]" where len(TOKENS(X)) < 2\nreturn sample')
    assert out == "chosen"


def test_a_from_import_in_the_body_is_not_a_from_clause(m):
    out = lmql.run_sync('from math import sqrt\n"Hi[X]" where len(TOKENS(X)) < 2\nreturn sqrt(16)')
    assert out == 4.0


# -- model clauses -------------------------------------------------------------------------------
def test_from_clause_naming_a_variable_of_the_calling_scope(m):
    tiny = m
    r = lmql.run_sync('argmax\n    "Hello[X]"\nfrom\n    tiny\nwhere\n    len(TOKENS(X)) < 2\n')
    assert r.prompt == "Hello" + r.variables["X"]
    assert tiny is m


def test_from_clause_with_a_model_expression(m):
    models = {"tiny": m}
    r = lmql.run_sync('argmax "Hello[X]" from models["tiny"] where len(TOKENS(X)) < 2')
    assert r.prompt == "Hello" + r.variables["X"]


def test_the_from_clause_is_not_evaluated_when_the_call_names_a_model(m):
    def unavailable():
        raise AssertionError("the from clause was evaluated")

    r = lmql.run_sync('argmax\n    "Hello[X]"\nfrom\n    unavailable()\nwhere\n    len(TOKENS(X)) < 2\n', model=m)
    assert r.prompt == "Hello" + r.variables["X"]


# -- prompt strings ------------------------------------------------------------------------------
def test_regex_tactic_constrains_the_hole(m):
    r = lmql.run_sync('"A: Today is [RESPONSE: r\'[0-9]{2}/[0-9]{2}\']\\n"')
    assert re.fullmatch(r"[0-9]{2}/[0-9]{2}", r.variables["RESPONSE"])
    assert r.prompt == "A: Today is " + r.variables["RESPONSE"] + "\n"


def test_regex_tactic_combines_with_the_statement_where(m):
    r = lmql.run_sync('"Code: [C: r\'[a-c]+\']" where len(TOKENS(C)) < 3')
    assert re.fullmatch("[a-c]+", r.variables["C"]) and len(m.tokenizer.encode(r.variables["C"])) < 3


def test_decorator_arguments_may_contain_spaces_and_brackets(m):
    r = lmql.run_sync('''
def prefix(p: str):
    def decorator(value: str):
        return p + value.strip()
    return decorator

"Say 'this is a test':[@prefix('PREFIX: [x] ') TEST]" where len(TOKENS(TEST)) < 3
''')
    assert r.variables["TEST"].startswith("PREFIX: [x] ")
    assert r.prompt == "Say 'this is a test':" + r.variables["TEST"]


def test_several_decorators_with_arguments_apply_innermost_last_listed_first(m):
    r = lmql.run_sync('''
def tag(t):
    return lambda v: t + "(" + v + ")"

"[@tag('a ') @tag('b ') X]" where len(TOKENS(X)) < 2
''')
    assert r.variables["X"].startswith("a (b (")


def test_a_tactic_with_brackets_inside_a_string(m):
    @lmql.query
    def inner(s):
        '''lmql
        "{s}[Y]" where len(TOKENS(Y)) < 2
        return s
        '''

    r = lmql.run_sync('"Q: [R: inner(s=\'[INST] a ] b\')]"')
    assert r.variables["R"] == "[INST] a ] b"


def test_a_decoder_for_one_variable_is_a_clear_error(m):
    with pytest.raises(kvql.QuerySyntaxError, match="decoder for one variable"):
        lmql.query('"Hello[sample(n=2) WHO]!"')


# -- where clauses -------------------------------------------------------------------------------
def test_a_global_where_with_and_next_to_an_inline_where_is_flattened(m):
    r = lmql.run_sync('argmax\n'
                      '    "A: [X]" where STOPS_AT(X, ".")\n'
                      'where\n'
                      '    X in ["a.", "b."] and len(TOKENS(X)) < 5\n')
    assert r.variables["X"] in ("a.", "b.")


def test_a_generated_variable_used_where_constraints_cannot_follow_it_is_an_error(m):
    with pytest.raises(kvql.QuerySyntaxError, match=r"cannot enforce 'X\[0\]'"):
        lmql.query('"A: [X]" where X[0] == "a"')
    with pytest.raises(kvql.QuerySyntaxError, match=r"cannot enforce 'X.upper\(\)'"):
        lmql.query('"A: [X]" where X.upper() == "A"')


def test_a_helper_with_a_docstring_before_the_decoder_clause_is_part_of_the_prologue(m):
    r = lmql.run_sync('def helper():\n'
                      '    "A docstring, not a prompt."\n'
                      '    return 7\n'
                      'argmax\n'
                      '    "N={helper()}[X]"\n'
                      'where\n'
                      '    len(TOKENS(X)) < 2\n')
    assert r.prompt.startswith("N=7")


def test_a_clause_given_twice_is_an_error_at_the_second(m):
    with pytest.raises(kvql.QuerySyntaxError, match="a second 'where' clause") as info:
        lmql.query('argmax\n    "Q: [X]"\nwhere len(TOKENS(X)) < 3\nwhere X in ["a"]\n')
    assert info.value.lineno == 4


def test_a_global_where_on_variables_no_prompt_generates_fails_at_the_call(m):
    q = lmql.query('''
argmax
    return 1
from
    "random"
where
    STOPS_AT(ANSWER, "test") and STOPS_AT(OTHER, "test")
''', is_async=False)  # defining it is fine, as in LMQL: the names could not be checked against inputs yet
    with pytest.raises(TypeError, match="Failed to resolve variables in LMQL query: 'ANSWER', 'OTHER'"):
        q(model=m)
