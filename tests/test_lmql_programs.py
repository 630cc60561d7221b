"""LMQL programs as people wrote them run unchanged (issue 24): each test states one behaviour of LMQL
(0.7.3, or its main branch where that changed a 0.7.3 rule, as named), on both query forms (a decorated
function, a query string) and both entry points (a call, `lmql.run` / `run_sync`), on the local engine
and through the remote backend.
"""

from __future__ import annotations

import asyncio
import warnings

import pytest

import kvql
import kvql as lmql


@pytest.fixture
def m(each_backend):
    return each_backend


# -- 1. a query that generates nothing returns its value itself -------------------------------------
def test_a_decorated_query_without_holes_returns_its_value(m):
    @lmql.query
    def f(x):
        '''lmql
        return x + 1
        '''

    @lmql.query
    async def g(x):
        '''lmql
        "some text"
        return x + 1
        '''

    assert f(1) == 2 and asyncio.run(g(1)) == 2


def test_a_query_string_without_holes_returns_its_value_on_every_entry_point(m):
    assert lmql.run_sync("return 5") == 5
    assert asyncio.run(lmql.run('"no holes"\nreturn 5')) == 5
    assert lmql.query("return a + b", is_async=False)(a=1, b=2) == 3


def test_without_holes_a_return_of_none_is_none_and_no_return_is_the_result(m):
    assert lmql.run_sync('"text"\nreturn None') is None
    r = lmql.run_sync('"no holes at all"')
    assert isinstance(r, lmql.LMQLResult) and r.prompt == "no holes at all" and r.variables == {}


def test_a_bare_return_gives_the_result_object_with_and_without_holes(m):
    r = lmql.run_sync('"Hi"\nreturn')
    assert isinstance(r, lmql.LMQLResult) and r.prompt == "Hi"
    r = lmql.run_sync('"Say[X]" where len(TOKENS(X)) < 3\nif True:\n    return\n"never"')
    assert isinstance(r, lmql.LMQLResult) and list(r.variables) == ["X"] and not r.prompt.endswith("never")


def test_a_method_query_without_holes_returns_its_value(m):
    class Agent:
        @lmql.query
        def act(self, s):
            '''lmql
            return s, self
            '''

    a = Agent()
    assert a.act("go") == ("go", a)


# -- 2. blank lines inside a multi-line prompt string ------------------------------------------------
@pytest.mark.parametrize("source, prompt", [
    ('"""Line one.\n\nLine two."""', "Line one.\nLine two."),
    ('"""A\n\n\nB"""', "A\nB"),
    ('"""A\n   \nB"""', "A\nB"),              # whitespace only counts as blank
    ('"A\\n\\nB"', "A\n\nB"),                  # escaped newlines are text
    ('"""A\\n\nB"""', "A\n\nB"),
    ('"""A\n    B\n  C"""', "A\n    B\n  C"),  # indentation inside the string stays
    ('"""\nA\nB\n"""', "\nA\nB\n"),
])
def test_blank_lines_of_a_prompt_string_are_dropped_as_lmql_drops_them(m, source, prompt):
    # measured with LMQL 0.7.3 itself (scripts/lmql_differential.py)
    assert lmql.run_sync(source).prompt == prompt


def test_a_blank_line_is_dropped_in_a_decorated_query_too_and_before_a_hole(m):
    @lmql.query
    def q(x):
        '''lmql
        """Question: {x}

        Answer:[A]""" where len(TOKENS(A)) < 2
        '''

    assert q("why?").prompt.startswith("Question: why?\nAnswer:")


def test_an_error_after_a_dropped_blank_line_points_at_its_own_line(m):
    with pytest.raises(kvql.QuerySyntaxError) as info:
        lmql.query('"""A\n\nB {x!z}"""')
    assert (info.value.lineno, info.value.offset) == (3, 5)


# -- 3. a later hole's conditions are evaluated when that hole is generated ---------------------------
def test_a_global_where_reads_the_programs_values_when_each_hole_is_generated(m):
    @lmql.query
    def q():
        '''lmql
        opts = []
        "First:[A]\\n"
        opts.append(" yes")
        opts.append(" no")
        "Second:[B]"
        return A, B
        where len(TOKENS(A)) < 3 and B in opts
        '''

    a, b = q()
    assert b in (" yes", " no") and a


def test_a_later_holes_bad_condition_still_fails_when_that_hole_is_generated(m):
    src = 'argmax\n    opts = []\n    "First:[A]"\n    "Second:[B]"\nwhere len(TOKENS(A)) < 3 and B in opts'
    with pytest.raises(ValueError, match=r"'B in \[\]': the list of choices is empty"):
        lmql.run_sync(src)


# -- 4. a call keyword that names a parameter is the parameter ------------------------------------------
def test_a_parameter_named_model_is_an_input_not_the_model_choice(m):
    @lmql.query
    def q(description, model):
        '''lmql
        "Describe {description}:[D]" where len(TOKENS(D)) < 3
        return description, model
        '''

    assert q(description="hi", model="gpt-4") == ("hi", "gpt-4")
    assert q("hi", "any name") == ("hi", "any name")


def test_a_query_that_reads_a_name_like_an_option_gets_it_as_input(m):
    assert lmql.run_sync("return decoder, n", decoder="mine", n=7) == ("mine", 7)


def test_model_is_still_the_model_where_no_parameter_has_that_name(m, make_model):
    @lmql.query
    def q(x):
        '''lmql
        "{x}[Y]" where len(TOKENS(Y)) < 3
        return Y
        '''

    other = make_model()
    assert q("Hi", model=other) == q("Hi")  # the same weights: the same greedy value


# -- 5. runtime options LMQL passes on are accepted -------------------------------------------------------
def test_an_unknown_call_keyword_is_ignored_with_a_warning(m):
    # SGLang's LMQL benchmark backend calls its queries with stop=None
    @lmql.query
    def q(question):
        '''lmql
        "Q: {question} A:[ANSWER]" where len(TOKENS(ANSWER)) < 3
        return ANSWER
        '''

    expected = q("why?")
    with pytest.warns(UserWarning, match=r"ignores the option\(s\) \['stop'\]"):
        assert q("why?", stop=None) == expected


def test_an_unknown_decorator_option_is_ignored_with_a_warning(m):
    with pytest.warns(UserWarning, match="beams"):
        @lmql.query(beams=2)
        def q():
            '''lmql
            "Hi[X]" where len(TOKENS(X)) < 3
            return X
            '''
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert isinstance(q(), str)


def test_known_runtime_options_keep_their_meaning_at_the_call(m):
    @lmql.query
    def q():
        '''lmql
        "Hi[X]" where len(TOKENS(X)) < 3
        return X
        '''

    assert len(q(decoder="sample", n=3, temperature=0.9, seed=1)) == 3


# -- 6. the standalone form's clause keywords are found at any indentation ------------------------------
def test_an_indented_decoder_keyword_opens_the_decoder_clause(m):
    # a plain docstring whose `where` is less indented than its decoder (LMQL 0.7.3 runs it)
    @lmql.query
    def q():
        """
            sample(n=2)
                "Hello[X]"
        where len(TOKENS(X)) < 3
        """

    rs = q()
    assert isinstance(rs, list) and len(rs) == 2 and all(r.prompt.startswith("Hello") for r in rs)
    r = lmql.run_sync('    argmax\n        "Hi[X]"\nwhere len(TOKENS(X)) < 2')
    assert list(r.variables) == ["X"]


def test_from_and_where_at_the_bodys_indentation_are_clauses(m, make_model):
    named = make_model()
    r = lmql.run_sync('argmax\n    "Hello[X]"\n    from m\n    where len(TOKENS(X)) < 3', m=named)
    assert len(named.tokenizer.encode(r.variables["X"], add_special_tokens=False)) <= 2


def test_clause_words_used_as_python_names_stay_python(m):
    src = 'argmax\n    where = 3\n    if where:\n        from os import path\n    "Hi[X]" where len(TOKENS(X)) < 2\n    return where'
    assert lmql.run_sync(src) == 3


# -- 7. the state decorators and output writers receive ------------------------------------------------
def test_a_streaming_decorator_gets_a_program_state_with_the_diff_of_each_step(m):
    from kvql.runtime.program_state import ProgramState  # LMQL's module path, under kvql

    seen = []

    @lmql.decorators.streaming
    def watch(value, context):
        seen.append((value, context.get_diff("X"), context.get("X"), context.final("X"), context.get("A")))

    r = lmql.run_sync('"One:[A]" where len(TOKENS(A)) < 2\n"Two:[@watch X]" where len(TOKENS(X)) < 4', watch=watch)
    values = [v for v, *_ in seen]
    assert values[:2] == ["", ""] and values[-1] == r.variables["X"] and len(values) == 2 + r.trace.holes[-1].tokens + 1
    # the text the latest token added (all of it where a token's bytes completed an earlier character); the
    # final value's repeated call adds nothing, so the diffs add up to the value (LMQL 0.7.3 repeated the last)
    grown = values[2:-1]
    assert [d for _, d, *_ in seen[2:-1]] == [v[len(p):] if v.startswith(p) else v for v, p in zip(grown, [""] + grown)]
    assert seen[0][1] == seen[1][1] == "" and seen[-1][1] == ""
    assert "".join(d for _, d, *_ in seen) == r.variables["X"]
    assert all(v == got and fin == "var" and a == r.variables["A"] for v, _, got, fin, a in seen)
    assert ProgramState  # the class decorators are annotated with


def test_pre_and_post_decorators_get_the_state_of_the_holes_before(m):
    states = []

    def post(value, prompt_value, context):
        states.append(context)
        return value.upper()

    r = lmql.run_sync('"A:[A]" where len(TOKENS(A)) < 2\n"B:[@post B]" where len(TOKENS(B)) < 3', post=post)
    (state,) = states
    assert state.get("A") == r.variables["A"] and state.final("A") == "fin" and state.get("B") is None
    assert state.prompt.startswith("A:") and r.variables["B"] == r.variables["B"].upper()


def test_an_output_writer_gets_lmqls_program_state(m):
    got = []

    class Writer:
        async def add_interpreter_head_state(self, variable, head, prompt, where, trace, is_valid, is_final, mask,
                                             num_tokens, program_variables):
            got.append((variable, prompt, program_variables))

    r = lmql.run_sync('"Hi[X]" where len(TOKENS(X)) < 3', output_writer=Writer())
    *growing, (variable, prompt, state) = got  # a call per token, then the run's end
    assert variable == "X" and prompt == r.prompt == state.prompt
    assert state.variable_values == r.variables and state.get("X") == r.variables["X"] == state["X"]
    assert state.get_program_value("X") == r.variables["X"] and state.final("X") == "fin"
    # what a real LMQL program's writer reads to know whether the run has ended (module doc of program_state)
    assert state.runtime.root_state.query_head.result is r
    assert growing and all(s.runtime.root_state.query_head.result is None and s.final("X") == "var"
                           for _, _, s in growing)


# -- 8. a stop phrase inside a value the grammar fixes ---------------------------------------------------
@pytest.mark.parametrize("where, value", [
    ("""STOPS_BEFORE(X, '",') and X == 'abc",'""", "abc"),
    ("""STOPS_AT(X, '",') and X == 'abc",'""", 'abc",'),
    ("""STOPS_BEFORE(X, 'b') and X == 'abc'""", "a"),   # LMQL 0.7.3 gives "a" (measured)
    ("""STOPS_AT(X, 'b') and X == 'abc'""", "ab"),
])
def test_a_stop_phrase_cuts_a_fixed_value_where_it_appears(m, where, value):
    r = lmql.run_sync(f'"Say:[X]" where {where}')
    assert r.variables["X"] == value and r.prompt == "Say:" + value


def test_a_value_that_breaks_its_grammar_before_the_stop_phrase_is_still_an_error(m):
    with pytest.raises(lmql.UnmetConstraint):
        lmql.run_sync('"Say:[X]" where STOPS_AT(X, "c") and X == "abc" and len(TOKENS(X)) < 2')


# -- 9. lmql.algorithms ----------------------------------------------------------------------------------
def test_algorithms_map_runs_a_query_per_item_in_order(m):
    import kvql.algorithms as la

    q = lmql.F("Summarize this text: {text}: [SUMMARY]", "len(TOKENS(SUMMARY)) < 4", is_async=True)
    data = ["A dog walks into a bar.", "A cat goes for a walk.", "A dog walks into a bar."]
    r = asyncio.run(la.map(q, data))
    assert len(r) == 3 and all(isinstance(x, str) for x in r) and r[0] == r[2]
    assert r == [q.run_sync(d) for d in data]
    by_string = asyncio.run(la.map("Summarize this text: {text}: [SUMMARY]", data, where="len(TOKENS(SUMMARY)) < 4",
                                   chunksize=2))
    assert by_string == r


def test_algorithms_reduce_folds_with_a_query_or_a_function(m):
    assert asyncio.run(lmql.algorithms.reduce(lambda a, b: a + b, [1, 2, 3])) == 6

    @lmql.query
    async def longer(a, b):
        '''lmql
        return a if len(a) >= len(b) else b
        '''

    assert asyncio.run(lmql.algorithms.reduce(longer, ["ab", "abcd", "abc"], "")) == "abcd"


# -- 10. LMQL's OpenAI model names -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["openai/gpt-3.5-turbo-instruct", "chatgpt", "gpt-4", "openai/text-davinci-003"])
def test_an_openai_model_name_says_kvql_runs_local_models_and_servers(name):
    with pytest.raises(lmql.ModelLoadError, match="OpenAI-hosted model") as info:
        lmql.model(name)
    assert "hf download" not in str(info.value) and "--model" in str(info.value) and "http://" in str(info.value)


def test_a_query_from_an_openai_model_runs_on_the_model_given_at_the_call(m):
    q = lmql.query('argmax\n    "Hi[X]" where len(TOKENS(X)) < 2\nfrom "openai/gpt-3.5-turbo-instruct"', is_async=False)
    assert list(q(model=m).variables) == ["X"]
    with pytest.raises(lmql.ModelLoadError, match="OpenAI-hosted"):
        q()


# -- 11. the hole that used up the budget is named -------------------------------------------------------
def test_a_hole_without_a_token_bound_that_ate_max_len_is_named_by_the_next_hole(m):
    src = '"Count:[N]" where INT(N)\n"Next:[M]" where len(TOKENS(M)) < 3'
    with pytest.raises(lmql.QueryError) as info:
        lmql.run_sync(src, max_len=16)
    message = str(info.value)
    assert "before [M]" in message and "hole N used it up" in message and "len(TOKENS(N))" in message


def test_lmqls_context_inside_a_query_reads_the_run_so_far(m):
    r = lmql.run_sync('"A:[A]" where len(TOKENS(A)) < 2\n'
                      'return context.prompt, context.num_calls, await context.get_var("A"), await context.get_all_vars()')
    prompt, calls, a, everything = r
    assert prompt == "A:" + a and calls == 1 and everything == {"A": a}
