"""LMQL compatibility of the public API (issue 9, items 6, 7 and 9): model objects with LMQL's generate /
score, ScoringResult, calling conventions, output writers, certificates, lmql.main, legacy result[0].

Each test states one behaviour that LMQL 0.7.3's docs or tests specify. The model is LMQL's `"random"`
test model (a tiny random-weights Llama with SmolLM2's tokenizer) or the tiny model of conftest.py:
generated text is gibberish, so the tests check shapes, types and agreement with kvql's own API.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import warnings

import numpy as np
import pytest
import torch

import kvql
import kvql as lmql  # ordinary LMQL code should run with this import


@pytest.fixture
def m(each_backend):
    """Each test runs on the local engine and through the remote backend on `kvql serve`."""
    return each_backend

CONSTANT = 1  # read by queries through their defining module's globals


@pytest.fixture
def rnd():
    """LMQL's `lmql.model("random", seed=123)`, also the default model."""
    m = lmql.model("random", seed=123)
    lmql.set_default_model(m)
    yield m
    lmql.set_default_model(None)


@pytest.fixture
def tiny(local):
    """The tiny model of conftest.py (a 512-token context) on the local engine, also the default model."""
    return local


def printed(fn):
    """(fn(), what it printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        value = fn()
    return value, out.getvalue()


# -- lmql.model("random", seed=...) ----------------------------------------------------------------
def test_random_model_with_the_same_arguments_is_one_shared_model():
    assert lmql.model("random", seed=123) is lmql.model("random", seed=123)
    assert isinstance(lmql.model("random", seed=123), lmql.LLM)


def test_random_model_seed_decides_its_weights_and_so_its_output():
    a, b = lmql.model("random", seed=1), lmql.model("random", seed=2)
    assert lmql.generate_sync("Test", max_tokens=8, model=a) != lmql.generate_sync("Test", max_tokens=8, model=b)
    assert lmql.generate_sync("Test", max_tokens=8, model=a) == lmql.generate_sync("Test", max_tokens=8, model=a)


def test_random_model_uses_the_smollm2_tokenizer():
    m = lmql.model("random", seed=123)
    assert len(m.tokenizer) == 49152 and m.tokenizer.eos_token == "<|im_end|>"


def test_random_model_is_a_valid_from_clause_model_name(rnd):
    r = lmql.run_sync('argmax "Hi[SEP]" from "random" where len(TOKENS(SEP)) < 4')
    assert r.prompt == "Hi" + r.variables["SEP"]


def test_seed_is_refused_for_models_with_fixed_weights(tmp_path):
    with pytest.raises(TypeError, match="random"):
        lmql.model(str(tmp_path), seed=1)


# -- generate ------------------------------------------------------------------------------------
def test_generate_sync_returns_the_generated_text_without_the_prompt(rnd):
    text = lmql.generate_sync("Test", max_tokens=10)
    assert type(text) is str and text
    # as LMQL sends it: the tokenizer's BOS first (SmolLM2's tokenizer adds none itself)
    ids = [rnd.tokenizer.bos_token_id] + rnd.tokenizer.encode("Test", add_special_tokens=False)
    assert text == rnd.complete([ids], max_tokens=10)[0].text


def test_generate_max_tokens_bounds_the_generated_tokens(rnd):
    text = lmql.generate_sync("Test", max_tokens=3)
    assert len(rnd.tokenizer.encode(text, add_special_tokens=False)) <= 3


def test_generate_without_max_tokens_runs_until_the_end_of_sequence_within_the_context(tiny, tokenizer):
    prompt = "Once upon a time"
    room = tiny.context_length - len(tokenizer.encode(prompt))
    assert lmql.generate_sync(prompt) == tiny.complete([prompt], max_tokens=room)[0].text


def test_await_top_level_generate_returns_a_string(rnd):
    text = asyncio.run(lmql.generate("Test", max_tokens=10))
    assert type(text) is str and text == lmql.generate_sync("Test", max_tokens=10)


def test_await_model_generate_returns_a_string(rnd):
    text = asyncio.run(_await(lambda: rnd.generate("Test", max_tokens=10)))
    assert type(text) is str and text == lmql.generate_sync("Test", max_tokens=10)


def test_await_model_generate_with_n_returns_a_list_of_n_strings(rnd):
    argmax = asyncio.run(_await(lambda: rnd.generate("Test", max_tokens=10, temperature=0.2, n=2)))
    sampled = asyncio.run(_await(lambda: rnd.generate("Test", max_tokens=10, decoder="sample", n=2, seed=7)))
    assert type(argmax) is list and len(argmax) == 2 and argmax[0] == argmax[1]  # argmax: one answer, n times
    assert type(sampled) is list and len(sampled) == 2 and all(type(s) is str and s for s in sampled)


def test_model_generate_sync_method_returns_a_string(rnd):
    assert rnd.generate_sync("Test", max_tokens=10) == lmql.generate_sync("Test", max_tokens=10)


def test_model_generate_outside_an_event_loop_returns_kvql_completions(rnd):
    out = rnd.generate(["Test", "Test2"], max_tokens=4)
    assert type(out) is list and [type(c) for c in out] == [kvql.Completion] * 2


def test_model_generate_inside_an_event_loop_is_also_the_list_of_completions(rnd):
    async def sync_code_in_a_notebook_cell():
        out = rnd.generate(["Test", "Test2"], max_tokens=4)
        return len(out), [c.text for c in out], out == rnd.complete(["Test", "Test2"], max_tokens=4)

    n, texts, same = asyncio.run(sync_code_in_a_notebook_cell())
    assert n == 2 and same and texts == [c.text for c in rnd.generate(["Test", "Test2"], max_tokens=4)]


def test_awaited_model_generate_leaves_the_event_loop_free(rnd):
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        texts = await asyncio.gather(rnd.generate("A", max_tokens=64), rnd.generate("B", max_tokens=64))
        t.cancel()
        return texts, ticks

    texts, ticks = asyncio.run(main())
    assert all(type(s) is str for s in texts) and ticks > 2


def test_awaited_generate_refuses_kvql_batch_prompts_naming_agenerate(rnd):
    with pytest.raises(TypeError, match="agenerate"):
        asyncio.run(_await(lambda: rnd.generate(["a", "b"], max_tokens=2)))


async def _await(make):
    return await make()


# -- score ---------------------------------------------------------------------------------------
def test_score_of_a_string_value_scores_the_whole_continuation(rnd):
    s = lmql.score_sync("Hello", "World")
    assert s.continuations == ["World"] and len(s.seqs) == 1
    assert len(s.token_scores[0]) == len(rnd.tokenizer.encode("World", add_special_tokens=False))


def test_score_returns_a_scoring_result_with_lmql_shapes(rnd):
    s = lmql.score_sync("Test", "Test")
    assert type(s) is lmql.ScoringResult
    assert s.token_scores[0].shape == (1,) and np.array(s.full_token_scores[0]).shape == (2,)
    assert s.logprobs().shape == (1,)


def test_full_token_scores_are_zero_for_the_prompt_then_the_value_token_scores(rnd):
    s = lmql.score_sync("Hello there", ["World", "Test"])
    for full, value, n in zip(s.full_token_scores, s.token_scores, s.num_value_tokens):
        assert np.all(full[:len(full) - n] == 0.0) and np.array_equal(full[len(full) - n:], value)


def test_token_scores_are_the_model_log_probabilities_of_the_value_tokens(tiny, llama, tokenizer):
    prompt, value = "The quick brown", " fox jumps"
    s = lmql.score_sync(prompt, [value])
    ids = tokenizer(prompt).input_ids + tokenizer.encode(value, add_special_tokens=False)
    with torch.inference_mode():
        logp = torch.log_softmax(llama(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    n = s.num_value_tokens[0]
    expected = [float(logp[i - 1, ids[i]]) for i in range(len(ids) - n, len(ids))]
    assert s.token_scores[0] == pytest.approx(expected, abs=1e-4)


def test_scores_aggregate_by_sum_mean_or_length_normalized_sum(rnd):
    s = lmql.score_sync("Hello", ["World", "Apples and oranges"])
    sums = np.array([seq.logprobs.sum() for seq in s.seqs])
    lengths = np.array([len(seq) for seq in s.seqs])
    assert np.allclose(s.scores("sum"), sums)
    assert np.allclose(s.scores("mean"), sums / lengths)
    assert np.allclose(s.scores("normalized"), sums / lengths ** 0.7)
    assert np.allclose(s.scores("normalized", alpha=1.0), sums / lengths)
    with pytest.raises(ValueError, match="aggregation"):
        s.scores("median")


def test_logprobs_and_probs_are_normalized_over_the_values(rnd):
    s = lmql.score_sync("Hello", ["World", "Test", "Apples"])
    assert np.exp(s.logprobs()).sum() == pytest.approx(1.0) and s.probs().sum() == pytest.approx(1.0)
    assert np.allclose(s.logprobs() - s.logprobs()[0], s.scores() - s.scores()[0])


def test_argmax_is_the_value_with_the_highest_score(rnd):
    values = ["World", "Test", "Apples"]
    s = lmql.score_sync("Hello", values)
    assert s.argmax() == values[int(np.argmax(s.scores()))]
    assert s.argmax("mean") == values[int(np.argmax(s.scores("mean")))]


def test_model_score_methods_agree_with_top_level_score(rnd):
    a = asyncio.run(rnd.score("Hello", ["World", "Test"]))
    b = rnd.score_sync("Hello", ["World", "Test"])
    c = lmql.score_sync("Hello", ["World", "Test"], model=rnd)
    assert np.allclose(a.scores(), b.scores()) and np.allclose(b.scores(), c.scores())


def test_scoring_result_keeps_kvql_score_result_names(rnd):
    s = lmql.score_sync("Hello", ["World", "Test"])
    assert isinstance(s, kvql.ScoreResult) and s.values == ["World", "Test"]
    assert list(s.logprobs) == pytest.approx(list(s.scores("sum")))  # read as a list: the summed logprobs


def test_scoring_result_prints_each_value_with_its_score(rnd):
    text = str(lmql.score_sync("Hello", ["World", "Test"]))
    assert text.startswith("lmql.ScoringResult(model='random')") and "-World: " in text and "-Test: " in text


# -- calling conventions -------------------------------------------------------------------------
class Agent:
    def __init__(self):
        self.memory = "remembered"

    @lmql.query
    async def interact(self, s: str, a=12):
        '''lmql
        argmax
            return s, a, self, CONSTANT
        '''


def test_query_defined_on_a_method_binds_self(rnd):
    agent = Agent()
    assert asyncio.run(agent.interact("Hi", a=8)) == ("Hi", 8, agent, CONSTANT)
    assert asyncio.run(agent.interact("Hi")) == ("Hi", 12, agent, CONSTANT)


def test_decorated_query_without_parameters_takes_its_inputs_as_keywords(rnd):
    @lmql.query
    async def noinput():
        '''lmql
        return s, CONSTANT
        '''

    assert asyncio.run(noinput(s="test")) == ("test", CONSTANT)


def test_query_string_binds_positional_arguments_in_order_of_first_use(rnd):
    source = '''lmql
    "Summarize this text: {t1}{t2}: [SUMMARY]" where len(TOKENS(SUMMARY)) < 4
    return SUMMARY
    '''
    assert lmql.run_sync(source, "This is ", "a test.") == lmql.run_sync(source, t1="This is ", t2="a test.")
    q = lmql.query("return (a, b)", is_async=False)
    assert q(1, 2) == (1, 2)


def test_query_string_with_too_many_positional_arguments_raises_type_error(rnd):
    q = lmql.query("return a", is_async=False)
    with pytest.raises(TypeError, match="positional"):
        q(1, 2)


def test_input_variables_give_a_query_string_positional_parameters(rnd):
    multipos = lmql.query('''lmql
    argmax
        return s, a
    ''', input_variables=["s", "a"])
    assert asyncio.run(multipos("Hi", 8)) == ("Hi", 8)
    assert asyncio.run(multipos("Hi", a=8)) == ("Hi", 8)
    assert asyncio.run(multipos(s="Hi", a=8)) == ("Hi", 8)


def test_query_string_is_async_by_default_and_sync_on_request(rnd):
    assert asyncio.iscoroutine(pending := lmql.query("return 1")())
    assert asyncio.run(pending) == 1
    assert lmql.query("return 1", is_async=False)() == 1


def test_f_with_is_async_returns_an_awaitable(rnd):
    f = lmql.F("Summarize this text: {text}: [SUMMARY]", "len(TOKENS(SUMMARY)) < 5", is_async=True)
    assert type(asyncio.run(f(text="This is a test."))) is str


def test_query_of_a_query_object_is_the_same_query(rnd):
    q = lmql.query("return 1", is_async=False)
    assert lmql.query(q) is q


# -- undefined inputs (item 9) -------------------------------------------------------------------
def test_undefined_input_raises_type_error_at_the_call_not_at_definition(rnd):
    q = lmql.query("return s")  # defining it is fine
    with pytest.raises(TypeError, match="Failed to resolve variable 's'"):
        asyncio.run(q())


def test_undefined_input_is_reported_before_the_query_runs(rnd):
    before = rnd.stats()["generated_tokens"]

    @lmql.query
    def q():
        '''lmql
        "Hi [X]" where len(TOKENS(X)) < 3
        return missing_input
        '''

    with pytest.raises(TypeError, match="missing_input"):
        q()
    assert rnd.stats()["generated_tokens"] == before


def test_several_undefined_inputs_are_listed_in_one_type_error(rnd):
    with pytest.raises(TypeError, match="Failed to resolve variables in LMQL query: 'a', 'b'"):
        lmql.run_sync("return b, a")


def test_undefined_input_error_is_also_a_name_error(rnd):
    with pytest.raises(NameError, match="nowhere"):
        lmql.run_sync("return nowhere")


# -- output writers ------------------------------------------------------------------------------
def test_printing_writer_prints_the_final_prompt(rnd):
    r, out = printed(lambda: lmql.run_sync("'Q: Hello\\n A:[WHAT]' where len(TOKENS(WHAT)) < 4",
                                           output_writer=lmql.printing))
    assert r.prompt in out


def test_stream_writer_prints_the_value_of_its_variable(rnd):
    r, out = printed(lambda: lmql.run_sync("'Q: Hello\\n A:[WHAT]' where len(TOKENS(WHAT)) < 4",
                                           output_writer=lmql.stream("WHAT")))
    assert out == r.variables["WHAT"].strip()


def test_silent_and_headless_writers_print_nothing(rnd):
    for writer in (lmql.silent, lmql.headless):
        _, out = printed(lambda: lmql.run_sync("'Hi [X]' where len(TOKENS(X)) < 3", output_writer=writer))
        assert out == ""


def test_custom_output_writer_receives_the_prompt_and_variables(rnd):
    seen = []

    class Writer:
        async def add_interpreter_head_state(self, variable, head, prompt, where, trace, is_valid, is_final,
                                             mask, num_tokens, program_variables):
            seen.append((variable, prompt, dict(program_variables.variable_values), is_valid, is_final))

    r = lmql.run_sync("'A [X] B [Y]' where len(TOKENS(X)) < 3 and len(TOKENS(Y)) < 3", output_writer=Writer())
    assert seen[-1] == ("Y", r.prompt, r.variables, True, True)  # the run's end
    live = seen[:-1]  # then each token of each hole, as it is generated (tests/test_live_holes.py)
    assert [v for v, *_ in live] == ["X"] * r.trace.holes[0].tokens + ["Y"] * r.trace.holes[1].tokens
    assert all(valid and not final and r.prompt.startswith(prompt) for _, prompt, _, valid, final in live)
    assert live[-1][2] == r.variables


def test_output_writer_given_at_definition_applies_to_every_call(rnd):
    @lmql.query(output_writer=lmql.stream("X"))
    def q():
        '''lmql
        "Hi [X]" where len(TOKENS(X)) < 3
        '''

    r, out = printed(q)
    assert out == r.variables["X"].strip()


def test_output_writer_that_is_not_one_raises_type_error(rnd):
    with pytest.raises(TypeError, match="output_writer"):
        lmql.run_sync("'Hi [X]'", output_writer=print)


# -- certificates --------------------------------------------------------------------------------
def test_certificate_callable_receives_a_json_record_of_the_model_calls(rnd):
    got = []
    say_hello = lmql.F("Greet the world:[GREETING]", "len(TOKENS(GREETING)) < 5")
    value = say_hello(certificate=got.append)
    data = json.loads(str(got[0]))
    assert data["type"] == "lmql.InferenceCertificate" and data["model"]["name"] == "random"
    (call,) = [e["data"] for e in data["events"] if e["name"] == "kvql.generate"]
    assert call["name"] == "GREETING" and call["value"] == value
    assert data["prompts"][0]["token_ids"] == [t.id for t in say_hello.last_trace.tokens]


def test_certificate_path_writes_the_certificate_to_that_file(rnd, tmp_path):
    path = tmp_path / "my-certificate.json"
    lmql.F("Greet the world:[GREETING]", "len(TOKENS(GREETING)) < 5")(certificate=str(path))
    assert json.loads(path.read_text())["events"][-1]["name"] == "lmql.LMQLResult"


def test_certificate_true_prints_it(rnd):
    _, out = printed(lambda: lmql.run_sync("'Hi [X]' where len(TOKENS(X)) < 3", certificate=True))
    assert json.loads(out)["type"] == "lmql.InferenceCertificate"


def test_certificate_return_dict_returns_result_and_certificate(rnd):
    out = lmql.run_sync("'Hi [X]' where len(TOKENS(X)) < 3", certificate="return_dict")
    assert isinstance(out["result"], lmql.LMQLResult) and isinstance(out["certificate"], lmql.InferenceCertificate)


def test_generate_accepts_a_certificate(rnd):
    got = []
    text = lmql.generate_sync("Greet the animals of the world:", max_tokens=4, certificate=got.append)
    assert json.loads(str(got[0]))["events"][0]["data"]["value"] == text


# -- lmql.main, legacy result[0] -------------------------------------------------------------------
def test_main_runs_an_async_query_to_completion(rnd):
    @lmql.query
    async def q():
        '''lmql
        "Hi [X]" where len(TOKENS(X)) < 3
        '''

    assert isinstance(lmql.main(q), lmql.LMQLResult)


def test_result_index_zero_is_the_result_itself_with_a_deprecation_warning(rnd):
    r = lmql.run_sync("'Hi [X]' where len(TOKENS(X)) < 3")
    with pytest.warns(DeprecationWarning, match="result\\[0\\]"):
        assert r[0] is r
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(IndexError):
            r[1]


# -- variable decorators -------------------------------------------------------------------------
def test_pre_decorator_supplies_the_value_and_the_model_is_not_asked(rnd):
    @lmql.decorators.pre
    def fixed(variable):
        return "Fixed Value" if variable.name == "RESPONSE" else variable

    before = rnd.stats()["generated_tokens"]
    r = lmql.run_sync("'Say this:[@fixed RESPONSE]' where len(TOKENS(RESPONSE)) < 10")
    assert r.variables["RESPONSE"] == "Fixed Value" and r.prompt == "Say this:Fixed Value"
    assert rnd.stats()["generated_tokens"] == before


def test_pre_decorator_returning_the_variable_lets_the_model_generate(rnd):
    seen = []

    @lmql.decorators.pre
    def watch(variable, context):
        seen.append(variable.name)
        return variable

    r = lmql.run_sync("'Say this:[@watch RESPONSE]' where len(TOKENS(RESPONSE)) < 4")
    assert seen == ["RESPONSE"] and r.variables["RESPONSE"] == lmql.run_sync(
        "'Say this:[RESPONSE]' where len(TOKENS(RESPONSE)) < 4").variables["RESPONSE"]


def test_streaming_decorator_sees_the_value_grow_token_by_token(rnd):
    seen = []

    @lmql.decorators.streaming
    def watch(value, context):
        seen.append(value)

    r = lmql.run_sync("'Say this:[@watch RESPONSE]' where len(TOKENS(RESPONSE)) < 4")
    value = r.variables["RESPONSE"]
    # as LMQL calls it (its test_decorators.py): "" twice, each token's prefix, the final value again
    assert seen[:2] == ["", ""] and seen[-2:] == [value, value] and len(seen) == 2 + 3 + 1
    assert all(value.startswith(s) for s in seen) and seen == sorted(seen, key=len)


def test_post_decorator_with_prompt_value_sets_value_and_prompt_text_apart(rnd):
    def aslist(value, prompt_value, context):
        return value.split(), prompt_value

    r = lmql.run_sync("'Items:[@aslist ITEMS]' where len(TOKENS(ITEMS)) < 4")
    generated = r.prompt[len("Items:"):]
    assert generated and r.variables["ITEMS"] == generated.split()


def test_decorators_run_pre_in_order_and_post_in_reverse(rnd):
    calls = []

    def a(value):
        calls.append("post a")
        return value

    def b(value):
        calls.append("post b")
        return value

    lmql.run_sync("'X:[@a @b X]' where len(TOKENS(X)) < 3")
    assert calls == ["post b", "post a"]


def test_a_keyword_the_query_reads_is_an_input_even_when_a_decoder_option_has_its_name(tiny):
    q = lmql.query('''
sample(n=n)
    "Pick {n}:[X]" where X in ["a", "b"]
''', is_async=False)
    rs = q(n=2, model=tiny, seed=0)
    assert isinstance(rs, list) and len(rs) == 2 and all(r.prompt.startswith("Pick 2:") for r in rs)


def test_a_query_method_as_a_hole_type_runs_nested_with_self(tiny):
    class Helper:
        label = "Q"

        @lmql.query(model=tiny)
        def step(self):
            '''lmql
            "{self.label}:[Y]" where Y in [" one", " two"]
            return Y.strip()
            '''

        @lmql.query(model=tiny)
        def main(self):
            '''lmql
            "Start [A: self.step] and [B: self.step()]"
            return A, B
            '''

    a, b = Helper().main()
    assert a in ("one", "two") and b in ("one", "two")


def test_tokenizer_of_a_model_spec_is_callable_on_text():
    t = lmql.tokenizer("random")
    ids = t("Hello world")["input_ids"]
    assert ids and t.decode(ids) == "Hello world"
    with pytest.raises(lmql.ModelLoadError):
        lmql.tokenizer("no/such-model-here")


def test_a_query_that_ends_before_its_first_hole_returns_its_value_itself(tiny):
    # LMQL's rule since 0.7.3 (its test_return_value.py; the 0.7.3 release on PyPI wrapped it in a list)
    q = lmql.query('''
argmax
    return s, 1
''', is_async=False)
    assert q(s="hi", model=tiny) == ("hi", 1)
    assert q(s="hi", model=tiny, decoder="sample", n=2) == ("hi", 1)  # one value, whatever the decoder
    with_hole = lmql.query('''
argmax
    "Pick[X]" where X in [" a", " b"]
    return s
''', is_async=False)
    assert with_hole(s="hi", model=tiny) == "hi"  # a query that generates returns its one result itself


def test_a_query_that_never_generates_never_loads_its_model():
    # as in LMQL, whose own tests name hosted models in queries that only return their inputs
    q = lmql.query('''
argmax
    return s
from
    "no-such-org/no-such-model"
''', is_async=False)
    assert q(s="hi") == "hi"
    generating = lmql.query('''
argmax
    "Say[X]" where len(TOKENS(X)) < 2
from
    "no-such-org/no-such-model"
''', is_async=False)
    with pytest.raises(lmql.ModelLoadError, match="no-such-org/no-such-model"):
        generating()
