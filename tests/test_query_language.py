"""LMQL compatibility of the query language: each test is a query asserting what LMQL specifies.

The model is the tiny random Llama of conftest.py, so generated text is gibberish: the tests check
structure, constraints, decoding and caching, never meaning. Every test that takes `m` runs twice: on
the local engine, and through the remote backend on a `kvql serve` subprocess serving the same model
(with its tokenizer, so prompts travel as token ids); tests of the local engine's own state take `local`.
"""

from __future__ import annotations

import asyncio
import copy
import math
import re
import threading

import pytest

import kvql
import kvql as lmql  # ordinary LMQL code should run with this import

GLOBAL_TOPIC = "spiders"  # read by a query through the defining module's globals
SIDE_EFFECTS: list = []    # appended to by a query body, to count how often it runs


@pytest.fixture
def m(each_backend):
    return each_backend


def stat(m, key):
    return m.stats()[key]


def generated(m, fn):
    """(fn(), how many tokens the engine generated while running it)."""
    before = stat(m, "generated_tokens")
    out = fn()
    return out, stat(m, "generated_tokens") - before


# -- 1. entry points -----------------------------------------------------------------------------
def test_decorated_def_returns_its_result_synchronously(m):
    @lmql.query
    def ask(question):
        '''lmql
        "Q: {question}\nA:[ANSWER]" where len(TOKENS(ANSWER)) < 5
        '''

    r = ask("what is the capital of France?")
    assert r.prompt == "Q: what is the capital of France?\nA:" + r.variables["ANSWER"]
    assert isinstance(ask, kvql.Query) and ask.output_variables == ["ANSWER"]


def test_decorated_async_def_returns_an_awaitable(m):
    @lmql.query
    async def ask(question):
        '''lmql
        "Q: {question}\nA:[ANSWER]" where len(TOKENS(ANSWER)) < 5
        return ANSWER
        '''

    pending = ask("how many legs does a spider have?")
    assert asyncio.iscoroutine(pending) or isinstance(pending, asyncio.Future)
    assert isinstance(asyncio.run(pending), str)


def test_query_sees_globals_and_closure_of_its_defining_scope(m):
    suffix = "!"  # a local of the enclosing function, referenced only inside the query

    @lmql.query
    def topic():
        '''lmql
        "Tell me about {GLOBAL_TOPIC}{suffix} [FACT]" where len(TOKENS(FACT)) < 3
        '''

    r = topic()
    assert r.prompt.startswith("Tell me about spiders! ")


def test_query_from_a_string_is_async_by_default(m):
    q = lmql.query('"Say [X]" where len(TOKENS(X)) < 3\nreturn X')
    pending = q()
    assert asyncio.iscoroutine(pending)
    assert isinstance(asyncio.run(pending), str)
    q_sync = lmql.query('"Say [X]" where len(TOKENS(X)) < 3\nreturn X', is_async=False)
    assert isinstance(q_sync(), str)


def test_run_is_async_and_run_sync_is_not(m):
    src = '"Q: {question}\\nA: [ANSWER]" where len(TOKENS(ANSWER)) < 4'
    r = asyncio.run(lmql.run(src, question="why?"))
    assert r.prompt.startswith("Q: why?\nA: ") and "ANSWER" in r.variables
    r2 = lmql.run_sync(src, question="why?")
    assert r2.prompt == r.prompt and r2.variables == r.variables


def test_F_returns_the_value_of_one_hole_or_a_dict_of_several(m):
    one = lmql.F("Summarize {data}: [SUMMARY]", "len(TOKENS(SUMMARY)) < 4")
    assert isinstance(one(data="the quick brown fox"), str)
    assert isinstance(one("the quick brown fox"), str)
    two = lmql.F("A: [A] B: [B]", "A in ['x', 'y'] and B in ['u', 'v']")
    out = two()
    assert isinstance(out, dict) and set(out) == {"A", "B"}
    assert out["A"] in ("x", "y") and out["B"] in ("u", "v")
    number = lmql.F("A random number: [N: int]", "len(TOKENS(N)) < 3")
    several = number(decoder="sample", n=2, seed=0)
    assert isinstance(several, list) and len(several) == 2 and all(isinstance(v, int) for v in several)


def test_generate_and_generate_sync_complete_a_prompt(m):
    text = lmql.generate_sync("Once upon a time", max_tokens=5)
    assert isinstance(text, str)
    assert asyncio.run(lmql.generate("Once upon a time", max_tokens=5)) == text  # greedy by default
    direct = m.generate(["Once upon a time"], max_tokens=5)[0].text
    assert text == direct


def test_score_gives_logprobs_probs_and_argmax(m):
    values = ["Paris", "London", "eight"]
    s = lmql.score_sync("Question: what is the capital of France? Answer: ", values)
    assert isinstance(s, kvql.ScoreResult)
    assert len(s.logprobs) == 3 and all(lp <= 0 for lp in s.logprobs)
    assert sum(s.probs()) == pytest.approx(1.0)
    assert s.argmax() == values[s.logprobs.index(max(s.logprobs))]
    s2 = asyncio.run(lmql.score("Question: what is the capital of France? Answer: ", values))
    assert s2.logprobs == pytest.approx(s.logprobs, abs=1e-4)


def test_set_default_model_is_used_by_queries_naming_no_model(make_model):
    a = make_model()
    kvql.set_default_model(a)
    try:
        lmql.run_sync('"Hello [X]" where len(TOKENS(X)) < 3')
        assert stat(a, "prompt_tokens") > 0
    finally:
        kvql.set_default_model(None)


def test_call_time_overrides_model_decoder_n_temperature_max_len(m, make_model, tokenizer):
    other = make_model()

    @lmql.query
    def q():
        '''lmql
        "Once upon a time[X]" where len(TOKENS(X)) < 6
        return X
        '''

    before = stat(m, "prompt_tokens")
    q(model=other)
    assert stat(other, "prompt_tokens") > 0 and stat(m, "prompt_tokens") == before
    outs = q(decoder="sample", n=3, temperature=0.8, seed=1)
    assert isinstance(outs, list) and len(outs) == 3 and all(isinstance(o, str) for o in outs)
    prompt_len = len(tokenizer("Once upon a time").input_ids)
    _, n_gen = generated(m, lambda: q(max_len=prompt_len + 2))
    assert 1 <= n_gen <= 2  # max_len bounds prompt + generated tokens


# -- 2. program forms ----------------------------------------------------------------------------
@pytest.mark.parametrize("clause,count", [("argmax", None), ("sample(n=2, temperature=0.8)", 2), ("beam(n=3)", 3)])
def test_modern_syntax_decoder_clause_on_the_first_line(m, clause, count):
    out = lmql.run_sync(f'{clause}\n"Once upon a time[X]" where len(TOKENS(X)) < 4\nreturn X')
    if count is None:
        assert isinstance(out, str)
    else:
        assert isinstance(out, list) and len(out) == count and all(isinstance(o, str) for o in out)


def test_standalone_form_with_from_where_distribution(m):
    src = ('ARGMAX\n'
           '    "Q: is the sky blue?\\n"\n'
           '    "Thinking:[THOUGHT]"\n'
           '    "A: [ANSWER]"\n'
           'FROM\n'
           '    "tiny-random-model"\n'
           'WHERE\n'
           '    len(TOKENS(THOUGHT)) < 4\n'
           'DISTRIBUTION\n'
           '    ANSWER in ["yes", "no"]\n')
    r = lmql.run_sync(src, model=m)  # the call's model overrides the `from` clause
    assert r.prompt.startswith("Q: is the sky blue?\nThinking:")
    assert r.variables["ANSWER"] in ("yes", "no")
    assert r.prompt.endswith("A: " + r.variables["ANSWER"])
    assert sum(p for _, p in r.variables["P(ANSWER)"]) == pytest.approx(1.0)


def test_decoder_clause_inside_a_docstring_query(m):
    @lmql.query
    def q():
        '''lmql
        sample(n=2, temperature=0.9)
        # a comment line
        "Pick [X]" where X in ["a", "b"]  # a trailing comment
        return X
        '''

    out = q(seed=4)
    assert isinstance(out, list) and len(out) == 2 and set(out) <= {"a", "b"}


def test_where_clause_on_continuation_lines(m):
    src = ('"Greet: [G]" \\\n'
           '    where len(TOKENS(G)) < 4\n'
           '"and [H]" where (H.startswith("ab") and\n'
           '                 len(H) < 6)\n')
    r = lmql.run_sync(src)
    assert r.variables["H"].startswith("ab") and len(r.variables["H"]) < 6
    assert r.prompt == "Greet: " + r.variables["G"] + "and " + r.variables["H"]


# -- 3. body semantics ---------------------------------------------------------------------------
def test_quote_styles_and_backslash_continuations(m):
    src = ('"double " \'single \'\n'
           '"""triple\n'
           'line""" \\\n'
           '"[X]" where len(TOKENS(X)) < 3\n'
           '"tail"\n')
    r = lmql.run_sync(src)
    assert r.prompt == "double single triple\nline" + r.variables["X"] + "tail"


def test_interpolation_with_format_spec_and_conversion(m):
    x, name = 3.14159, "Bob"
    r = lmql.run_sync('"pi={x:.2f} name={name!r} sum={1 + 2} [X]" where len(TOKENS(X)) < 2')
    assert r.prompt.startswith("pi=3.14 name='Bob' sum=3 ")
    tricky = "[NOT_A_HOLE] {braces}"
    r = lmql.run_sync('"v={tricky} [X]" where X in ["ok"]')
    assert r.prompt == "v=[NOT_A_HOLE] {braces} ok" and list(r.variables) == ["X"]  # values are literal text


def test_escaped_braces_and_brackets_are_literal(m):
    r = lmql.run_sync('"{{\\"a\\": [[1, 2]]}} [X]" where X in ["ok"]')
    assert r.prompt == '{"a": [1, 2]} ok'
    assert list(r.variables) == ["X"]


def test_typed_int_hole_gives_an_int(m):
    @lmql.query
    def number():
        '''lmql
        "A number: [N: int]" where len(TOKENS(N)) < 4
        '''

    r = number()
    assert isinstance(r.variables["N"], int)
    assert r.prompt == "A number: " + str(r.variables["N"])  # the prompt holds str(value)


@lmql.query
def dateformat():
    '''lmql
    "(respond in DD/MM)[ANSWER]" where REGEX(ANSWER, r"[0-9]{2}/[0-9]{2}")
    return "date " + ANSWER
    '''


@lmql.query
def one_of(choices):
    '''lmql
    "Among {choices}, the most likely is [PICK]" where PICK in choices
    return PICK
    '''


def test_nested_query_hole_inserts_its_return_value_and_hides_its_prompt(m):
    r = lmql.run_sync('"Q: When was it? [ANSWER: dateformat]\\nDone."')
    assert re.fullmatch(r"date [0-9]{2}/[0-9]{2}", r.variables["ANSWER"])
    assert r.prompt == "Q: When was it? " + r.variables["ANSWER"] + "\nDone."
    assert "respond in" not in r.prompt


def test_nested_query_called_with_an_argument(m):
    r = lmql.run_sync('"Capital of France? [ANSWER: one_of([\'Paris\', \'London\'])] ok"')
    assert r.variables["ANSWER"] in ("Paris", "London")
    assert r.prompt == f"Capital of France? {r.variables['ANSWER']} ok"


def test_decorator_hole_post_processes_the_value(m):
    def screaming(value):
        return "LOUD:" + value.upper()

    r = lmql.run_sync('"Say it:[@screaming TEST]" where TEST in ["quiet"]')
    assert r.variables["TEST"] == "LOUD:QUIET"
    assert r.prompt == "Say it:LOUD:QUIET"


def test_chained_decorators_apply_innermost_first_as_in_python(m):
    def a(v):
        return "a(" + v + ")"

    def b(v):
        return "b(" + v + ")"

    r = lmql.run_sync('"S: [@a @b X]" where X in ["x"]')
    assert r.variables["X"] == "a(b(x))"  # LMQL's post stage runs c, b, a for [@a @b @c X]


def test_python_statements_between_prompts(m, capsys):
    src = '''
import math
def double(v):
    return v * 2
items = []
for i in range(3):
    "{i}:[ITEM]" where ITEM in ["a", "b"]
    items.append(ITEM)
n = 0
while True:
    n += 1
    if n == 2:
        break
assert len(items) == 3
await asyncio.sleep(0)
print("items", items)
if math.sqrt(double(8)) == 4:
    "|four"
else:
    "|other"
return items
'''
    items = lmql.run_sync(src)
    assert len(items) == 3 and all(i in ("a", "b") for i in items)
    assert "items" in capsys.readouterr().out


def test_a_query_may_start_with_a_hole(m):
    # the tiny tokenizer adds no BOS token, so the first hole has an empty prompt before it
    r = lmql.run_sync('"[X] and more" where X in ["start", "begin"]')
    assert r.prompt == r.variables["X"] + " and more"


@lmql.query
def items_list(n):
    '''lmql
    for i in range(n):
        "-[ITEM]\n" where ITEM in ["pen", "cup"]
    '''


def test_nested_query_without_return_is_a_macro_expansion(m):
    r = lmql.run_sync('"Pack:\\n[ITEMS: items_list(2)]Done."')
    assert re.fullmatch(r"Pack:\n-(pen|cup)\n-(pen|cup)\nDone\.", r.prompt)


def test_a_hole_name_used_again_keeps_its_last_value(m):
    r = lmql.run_sync('for w in ["a", "b", "c"]:\n    "{w}:[ITEM] " where ITEM in [w + "1", w + "2"]')
    assert r.variables["ITEM"] in ("c1", "c2")
    assert re.fullmatch(r"a:a[12] b:b[12] c:c[12] ", r.prompt)


@lmql.query
async def helper(word):
    '''lmql
    "Repeat {word}: [W]" where W == word
    return W.upper()
    '''


def test_a_query_can_await_another_query_as_a_function(m):
    out = lmql.run_sync('v = await helper("pen")\n"Got {v} [X]" where X in ["ok"]\nreturn v, context.prompt')
    assert out == ("PEN", "Got PEN ok")


def test_context_prompt_is_the_prompt_so_far(m):
    r = lmql.run_sync('"Hello [X]" where X in ["world"]\nseen = context.prompt\n"!"\nreturn seen')
    assert r == "Hello world"


CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}")


def test_role_tags_show_as_lmql_tags_in_the_result_prompt(llama, tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    chat = kvql.Model(llama, tok, cache_budget="8MB")
    try:
        r = lmql.run_sync('"{:system}Be brief.{:user}Say hi.{:assistant}[A]" where len(TOKENS(A)) < 3',
                          model=chat)
        a = r.variables["A"]
        # as LMQL shows them; only the model sees the chat template (tests/test_lmql_compat_runtime.py)
        assert r.prompt == "<lmql:system/>Be brief.<lmql:user/>Say hi.<lmql:assistant/>" + a
        assert "<|im_start|>" not in r.prompt
    finally:
        chat.close()


# -- 4. results ----------------------------------------------------------------------------------
def test_return_gives_the_returned_value(m):
    assert lmql.run_sync('"Pick [X]" where X in ["a", "b"]\nreturn {"x": X, "n": 7}')["n"] == 7


def test_n_greater_than_one_gives_a_list_of_n(m):
    rs = lmql.run_sync('sample(n=3)\n"Pick [X]" where X in ["a", "b", "c"]', seed=0)
    assert isinstance(rs, list) and len(rs) == 3
    assert all(isinstance(r, kvql.LMQLResult) and r.variables["X"] in "abc" for r in rs)


def test_result_object_has_prompt_and_variables(m):
    r = lmql.run_sync('"A [X] B [Y]" where X in ["x"] and Y in ["y", "z"]')
    assert isinstance(r, kvql.LMQLResult)
    assert r.prompt == f"A x B {r.variables['Y']}" and r.variables["X"] == "x"


def test_distribution_sets_probabilities_and_the_most_likely_value(m):
    r = lmql.run_sync('"Question: what is the capital of France? Answer:[A]" distribution A in [" Paris", " eight", " no"]')
    probs = dict(r.variables["P(A)"])
    logs = dict(r.variables["log P(A)"])
    assert set(probs) == {" Paris", " eight", " no"}
    assert sum(probs.values()) == pytest.approx(1.0)
    assert r.variables["A"] == max(probs, key=probs.get)
    for v in probs:
        assert logs[v] == pytest.approx(math.log(probs[v]))
    s = lmql.score_sync("Question: what is the capital of France? Answer:", list(probs))
    assert dict(zip(s.values, s.probs())) == pytest.approx(probs, abs=1e-4)


def test_output_variables_lists_the_holes(m):
    q = lmql.query('"A [X]" where X in ["x"]\nfor i in range(2):\n    "B [Y]" where Y in ["y"]')
    assert q.output_variables == ["X", "Y"]


# -- 5. constraints ------------------------------------------------------------------------------
def test_stops_at_keeps_the_phrase_and_ends_the_value(m):
    r = lmql.run_sync('"List:[X]\\nnext" where STOPS_AT(X, ".") and REGEX(X, r"[a-z ]{0,6}\\.[a-z]{0,5}")')
    x = r.variables["X"]
    assert x.endswith(".") and x.count(".") == 1
    assert r.prompt == "List:" + x + "\nnext"


def test_stops_before_drops_the_phrase(m):
    r = lmql.run_sync('"List:[X]|" where STOPS_BEFORE(X, ".") and REGEX(X, r"[a-z ]{0,6}\\.[a-z]{0,5}")')
    x = r.variables["X"]
    assert "." not in x and r.prompt == "List:" + x + "|"


def test_stops_at_newline(m):
    r = lmql.run_sync('"def add[X]\\nok" where STOPS_AT(X, "\\n") and REGEX(X, r"[a-z(]{0,4}\\n[a-z]{0,3}")')
    x = r.variables["X"]
    assert x.endswith("\n") and x.count("\n") == 1
    assert r.prompt == "def add" + x + "\nok"
    for seed in range(3):
        r = lmql.run_sync('sample\n"def add[X]" where STOPS_AT(X, "\\n") and len(TOKENS(X)) < 12', seed=seed)
        x = r.variables["X"]
        if "\n" in x:
            assert x.index("\n") == len(x) - 1


def test_stop_phrases_combined_with_or(m):
    r = lmql.run_sync('"Say:[X]|" where (STOPS_AT(X, ".") or STOPS_AT(X, "!")) and REGEX(X, r"[a-z]{0,4}[.!][a-z]{0,3}")')
    x = r.variables["X"]
    assert x[-1] in ".!" and sum(x.count(c) for c in ".!") == 1
    assert r.prompt == "Say:" + x + "|"


def test_token_length_bounds_the_generated_tokens(m):
    r, n = generated(m, lambda: lmql.run_sync('"Once upon a time[X]" where len(TOKENS(X)) < 5'))
    assert 1 <= n <= 4
    r2, n2 = generated(m, lambda: lmql.run_sync('"Once upon a time[X]" where len(TOKENS(X)) == 3'))
    assert n2 == 3


def test_constraints_read_python_values_of_the_query(m):
    limit = 3
    src = ('backpack = []\n'
           'for i in range(3):\n'
           '    "-[THING]\\n" where THING in ["pen", "cup", "hat"]\n'
           '    backpack.append(THING)\n'
           '"Best: [BEST] [MORE]" where BEST in backpack and len(TOKENS(MORE)) < limit\n'
           'return backpack, BEST, MORE')
    before = stat(m, "generated_tokens")
    backpack, best, more = lmql.run_sync(src)  # run_sync reads `limit` from this frame
    n = stat(m, "generated_tokens") - before
    assert best in backpack
    # at most a token per character, and the end-of-sequence token that ends each of the 4 choice holes
    assert n <= 4 + len("".join(backpack)) + len(best) + (limit - 1)


def test_choice_from_a_list(m):
    for seed in range(3):
        r = lmql.run_sync('sample\n"Pick: [X]" where X in ["Volleyball", "Sunscreen", "Bathing Suit"]', seed=seed)
        assert r.variables["X"] in ("Volleyball", "Sunscreen", "Bathing Suit")


def test_choices_whose_tokenizations_differ_and_overlap(m, tokenizer):
    choices = ["Paris", "Par", " Answer: Paris.", "Question"]
    assert len({len(tokenizer.encode(c)) for c in choices}) > 1
    rs = lmql.run_sync('sample(n=6)\n"Answer: [X]" where X in choices', seed=3)
    assert all(r.variables["X"] in choices for r in rs)


def test_INT_constraint_gives_an_int_value(m):
    r = lmql.run_sync('"A number: [N]" where INT(N) and len(TOKENS(N)) < 4')
    n = r.variables["N"]
    assert re.fullmatch(r" ?-?[0-9]+", str(n))
    assert isinstance(n, int)  # LMQL post-processes INT(N) to an int


def test_regex_constraint(m):
    r = lmql.run_sync('"today is [DATE]" where REGEX(DATE, r"[0-9]{2}/[0-9]{2}")')
    assert re.fullmatch(r"[0-9]{2}/[0-9]{2}", r.variables["DATE"])


def test_startswith_contains_and_not_contains(m):
    r = lmql.run_sync('"S: [X] and [Y] and [Z]" where X.startswith("Answer:") and len(TOKENS(X)) < 8 '
                      'and "s" in Y and len(Y) < 12 and not "e" in Z and len(Z) < 12')
    v = r.variables
    assert v["X"].startswith("Answer:")
    assert "s" in v["Y"] and len(v["Y"]) < 12
    assert "e" not in v["Z"] and len(v["Z"]) < 12


def test_character_length(m):
    r = lmql.run_sync('"Hello [NAME]" where len(NAME) < 10')
    assert len(r.variables["NAME"]) < 10


def test_equality_constraint(m):
    r = lmql.run_sync('"Say: [X]" where X == "the quick brown fox"')
    assert r.variables["X"] == "the quick brown fox"


def test_and_or_not_combinations(m):
    r = lmql.run_sync('"S: [X]|[Y]" where (X in ["cat", "dog"] or X == "fox") and not X == "dog" '
                      'and (REGEX(Y, "[0-9]+") or Y in ["none"]) and len(Y) < 4')
    assert r.variables["X"] in ("cat", "fox")
    assert re.fullmatch("[0-9]+", r.variables["Y"]) or r.variables["Y"] == "none"
    assert len(r.variables["Y"]) < 4


def test_stop_phrase_guarded_by_a_length_condition_fires_only_after_it(m, tokenizer):
    # 'a' is in most tokens of this grammar, so an unguarded stop would end the value at once
    r, n = generated(m, lambda: lmql.run_sync(
        '"Story:[X]" where STOPS_AT(X, "a") and len(TOKENS(X)) > 3 and len(TOKENS(X)) < 12 '
        'and REGEX(X, "[ab ]+")'))
    x = r.variables["X"]
    assert n >= 4
    assert x.endswith("a") and len(tokenizer.encode(x)) >= 4  # cut at the 'a' that ended generation


# -- 6. decoders ---------------------------------------------------------------------------------
def test_argmax_is_deterministic(m):
    src = '"Once upon a time[X] and[Y]" where len(TOKENS(X)) < 6 and len(TOKENS(Y)) < 6'
    a, b = lmql.run_sync(src), lmql.run_sync(src)
    assert a.prompt == b.prompt and a.variables == b.variables


def test_sample_with_a_seed_is_reproducible(m):
    src = 'sample(n=3, temperature=1.0)\n"Once upon a time[X]" where len(TOKENS(X)) < 8\nreturn X'
    a, b = lmql.run_sync(src, seed=7), lmql.run_sync(src, seed=7)
    assert a == b and len(a) == 3


def test_beam_returns_n_results(m):
    out = lmql.run_sync('beam(n=3)\n"Once upon a time[X]" where len(TOKENS(X)) < 4\nreturn X')
    assert isinstance(out, list) and len(out) == 3 and all(isinstance(o, str) for o in out)
    assert len(set(out)) == 3  # n distinct hypotheses


def test_query_options_given_to_the_decorator(m):
    @lmql.query(decoder="sample", n=2, temperature=0.7, seed=5)
    def q():
        '''lmql
        "Once upon a time[X]" where len(TOKENS(X)) < 4
        return X
        '''

    out = q()
    assert isinstance(out, list) and len(out) == 2 and out == q()


def test_python_side_effects_happen_once_per_sample(m):
    SIDE_EFFECTS.clear()
    src = ('SIDE_EFFECTS.append("start")\n'
           '"Once[X]" where len(TOKENS(X)) < 3\n'
           'SIDE_EFFECTS.append("middle")\n'
           '"upon[Y]" where len(TOKENS(Y)) < 3\n'
           'SIDE_EFFECTS.append("end")\n')
    lmql.run_sync("sample(n=3)\n" + src, seed=2)
    assert SIDE_EFFECTS.count("start") == SIDE_EFFECTS.count("middle") == SIDE_EFFECTS.count("end") == 3
    SIDE_EFFECTS.clear()
    lmql.run_sync("beam(n=2)\n" + src)
    assert SIDE_EFFECTS.count("start") == SIDE_EFFECTS.count("end") == 2
    SIDE_EFFECTS.clear()
    lmql.run_sync("argmax\n" + src)
    assert SIDE_EFFECTS == ["start", "middle", "end"]


# -- 7. concurrency ------------------------------------------------------------------------------
def test_many_runs_at_once_share_the_engine(local):
    q = lmql.query('"Q{i}: [X]" where len(TOKENS(X)) < 6\nreturn X')

    async def main():
        return await asyncio.gather(*(q(i=i) for i in range(8)))

    outs = asyncio.run(main())
    assert outs == [q.run_sync(i=i) for i in range(8)]  # batching does not change greedy output
    assert stat(local, "max_batch_requests") > 1


def test_runs_from_many_threads_share_the_engine(local):
    q = lmql.query('"Thread {i}: [X]" where len(TOKENS(X)) < 6\nreturn X', is_async=False)
    results = [None] * 6

    def work(i):
        results[i] = q(i=i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [q(i=i) for i in range(6)]
    assert stat(local, "max_batch_requests") > 1
    local.check_integrity()


def test_map_keeps_the_order_of_its_inputs(m):
    q = lmql.query('"Item {i}: [X]" where len(TOKENS(X)) < 3\nreturn (i, X)')
    outs = q.map([{"i": i} for i in range(10)], progress=True)
    assert [o[0] for o in outs] == list(range(10))


# -- 8. errors -----------------------------------------------------------------------------------
def test_syntax_error_names_line_and_column(m):
    bad = "y = 1 +* 2"
    try:
        compile(bad, "<x>", "exec")
    except SyntaxError as e:
        col = e.offset
    with pytest.raises(kvql.QuerySyntaxError) as info:
        lmql.query('"Hello [X]" where len(TOKENS(X)) < 3\nx = 1\n' + bad + '\n')
    assert info.value.lineno == 3 and info.value.offset == col
    assert isinstance(info.value, SyntaxError)


def test_unknown_constraint_is_reported(m):
    with pytest.raises(kvql.QuerySyntaxError, match="FOO"):
        lmql.run_sync('"Hello [X]" where FOO(X)')


def test_undefined_variable_raises_a_name_error_naming_it(m):
    with pytest.raises(NameError, match="undefined_thing"):
        lmql.run_sync('"Hello {undefined_thing} [X]" where len(TOKENS(X)) < 3')


def test_constraint_on_a_variable_no_prompt_generates(m):
    with pytest.raises(kvql.QuerySyntaxError, match="Y"):
        lmql.run_sync('"Hello [X]" where STOPS_AT(Y, ".") and len(TOKENS(X)) < 3')
    with pytest.raises((SyntaxError, NameError, kvql.QueryError), match="Y"):
        lmql.run_sync('"Hello [X]" where Y in ["a", "b"] and len(TOKENS(X)) < 3')


def test_malformed_hole_is_a_syntax_error(m):
    with pytest.raises(kvql.QuerySyntaxError) as info:
        lmql.query('"Hello"\n"Bad [1abc] hole"')
    assert info.value.lineno == 2


def test_unclosed_brace_is_a_syntax_error(m):
    with pytest.raises(kvql.QuerySyntaxError) as info:
        lmql.query('"ok [X]" where X in ["a"]\n"Hello {name"')
    assert info.value.lineno == 2


def test_unknown_decoder_and_unknown_nested_query_are_errors(m):
    with pytest.raises((ValueError, SyntaxError), match="nosuchdecoder"):
        lmql.run_sync('"Hi [X]" where X in ["a"]', decoder="nosuchdecoder")
    with pytest.raises(NameError, match="no_such_query"):
        lmql.run_sync('"Hi [X: no_such_query]"')


def test_a_failing_query_fails_alone(local):
    good = lmql.query('"Fine [X]" where len(TOKENS(X)) < 4\nreturn X')
    bad = lmql.query('"Fine [X]" where len(TOKENS(X)) < 4\nassert False, "boom"')

    async def main():
        return await asyncio.gather(good(), bad(), good(), return_exceptions=True)

    a, err, b = asyncio.run(main())
    assert isinstance(err, AssertionError) and "boom" in str(err)
    assert isinstance(a, str) and a == b
    assert stat(local, "running") == 0
    local.check_integrity()


# -- cache behaviour and exactness ---------------------------------------------------------------
FEW_SHOT = ("Question: what is the capital of France? Answer: Paris.\n"
            "Question: how many legs does a spider have? Answer: eight.\n") * 4


def test_running_the_same_query_again_computes_only_the_last_prompt_token(m):
    src = '"' + FEW_SHOT.replace("\n", "\\n") + 'Question: why? Answer:[X]" where len(TOKENS(X)) < 4'
    first = lmql.run_sync(src)
    second = lmql.run_sync(src)
    assert first.computed_tokens > 50
    assert second.computed_tokens == 1
    assert second.cached_tokens == first.computed_tokens - 1 + first.cached_tokens


def test_a_query_with_four_holes_computes_each_prompt_token_once(m, tokenizer):
    src = ('"' + FEW_SHOT.replace("\n", "\\n") + '"\n'
           'for i in range(4):\n'
           '    "Question {i}: what is it? Answer:[A]\\n" where len(TOKENS(A)) < 4\n')
    r = lmql.run_sync(src)
    total = len(tokenizer(r.prompt).input_ids)
    assert r.computed_tokens <= total + 8          # each hole adds only its new text
    assert r.cached_tokens >= 3 * len(tokenizer(FEW_SHOT).input_ids)  # the prefix is re-read, not recomputed


def test_map_over_inputs_sharing_a_few_shot_prefix_computes_it_once(m, tokenizer):
    q = lmql.query('"{shots}Question: {q}? Answer:[A]" where len(TOKENS(A)) < 3')
    before = m.stats()
    rs = q.map([{"shots": FEW_SHOT, "q": f"item {i}"} for i in range(20)])
    after = m.stats()
    prefix = len(tokenizer(FEW_SHOT).input_ids)
    computed = after["computed_tokens"] - before["computed_tokens"]
    assert computed < prefix + 20 * 8
    assert sum(r.cached_tokens for r in rs) >= 19 * (prefix - 2)


def test_results_are_identical_with_a_cleared_cache(local):
    src = ('"' + FEW_SHOT.replace("\n", "\\n") + '"\n'
           'for i in range(3):\n'
           '    "Question {i}:[A] Answer:[B]\\n" where len(TOKENS(A)) < 5 and len(TOKENS(B)) < 5\n')
    runs = []
    for _ in range(2):
        local.clear_cache()
        runs.append(lmql.run_sync(src))
    warm = lmql.run_sync(src)
    assert runs[0].prompt == runs[1].prompt == warm.prompt
    assert runs[0].variables == runs[1].variables == warm.variables


def test_operators_lmql_rejects_are_supported(m, tokenizer):
    """LMQL rejects <=, != and `not in`; kvql supports them with their Python meaning."""
    r, n = generated(m, lambda: lmql.run_sync(
        '"A: [X]|[Y]|[Z]" where len(TOKENS(X)) <= 2 and Y != "no" and Y in ["no", "yes"] '
        'and Z not in ["a", "b"] and Z in ["a", "b", "c"]'))
    v = r.variables
    assert v["Y"] == "yes" and v["Z"] == "c"
    assert len(tokenizer.encode(v["X"])) <= 2


def test_a_token_lower_bound_the_grammar_cannot_reach_is_an_error_on_every_backend(m):
    # the complete grammar ends the value early (vLLM's rule for min_tokens, on every backend): the value
    # breaks its where clause, so it is an error
    with pytest.raises(lmql.UnmetConstraint, match="X"):
        lmql.run_sync('"Letter:[X]" where REGEX(X, "[a-z]") and len(TOKENS(X)) > 2')


def test_a_choice_comes_out_in_its_canonical_tokenization(m, tokenizer):
    # the grammar alone admits any spelling of a choice in tokens (" " + "yes" for " yes"); kvql offers each
    # choice's own tokenization only, so the value's tokens are what the tokenizer makes of it
    choices = [" yes", " no", "hat", "cupcake", " the spider"]
    q = lmql.query('"{p}[X]" where X in ' + repr(choices) + '\nreturn X', is_async=False)
    for p in ["Once upon a time", "Q: yes or no?", "kvql serves", "The quick brown", "def add(a, b):",
              "Answer: Paris.", "a", "Question:"]:
        value = q(p=p)
        tokens = [t.id for t in q.last_trace.tokens if t.hole == "X"]
        assert value in choices and tokens == tokenizer.encode(value, add_special_tokens=False), (p, value, tokens)


def test_a_trace_names_its_query_model_inputs_and_where_clause_as_written(m):
    @lmql.query
    def greet(who):
        '''lmql
        sample(n=2)
        "Say hi to {who}:[X]" where len(TOKENS(X)) < 3 and STOPS_AT(X, ".")
        '''

    greet("Ada")
    traces = greet.last_traces
    assert [t.sample for t in traces] == [0, 1]
    for t in traces:
        assert (t.query, t.model, t.inputs) == ("greet", m.name, {"who": "Ada"})
        assert [h.constraints for h in t.holes] == ["len(TOKENS(X)) < 3 and STOPS_AT(X, '.')"]
