"""Token healing: `where HEAL(X)`, the decoder option `token_healing=True`, `Model.generate(heal=True)`.

The prompt's last token(s) are backed up and generated again, the text constrained to start with theirs
(and then to meet the hole's constraint), so that the model's own token may span the prompt's end. The
value excludes the backed-up text; its token bounds count the tokens that carry its text.
"""

from __future__ import annotations

import re

import pytest
import torch

import kvql
import kvql as lmql
from kvql.backends.base import Unsupported
from kvql.engine.decode.healing import MAX_TOKENS, healer

from conftest import reference_greedy

MID_WORD = "Question: what is the capi"   # the tiny tokenizer ends it with ' ca' 'p' 'i': 'pi' is backed up
SPACE = "Question: what is the "         # ends with a lone ' ' token
CLEAN = "Answer: Paris."                   # no run of its last tokens is the start of a longer token


def run(model, source: str):
    q = lmql.query(source)
    result = q.run_sync(model=model)
    return result, q.last_trace


def value_tokens(c) -> list[int]:
    return c.token_ids[c.healed_output_tokens:]


# -- which tokens are backed up ----------------------------------------------------------------------
def test_backs_up_the_longest_run_of_last_tokens_that_a_longer_token_starts_with(tokenizer):
    h = healer(tokenizer)
    ids = tokenizer.encode(MID_WORD)
    k = h.backup(ids)
    tail = lambda j: b"".join(h.pieces[t] for t in ids[-j:])  # noqa: E731
    assert k == 2 and tail(k) == b"pi"
    assert any(len(p) > len(tail(k)) and p.startswith(tail(k)) for p in h.pieces)
    assert all(tail(j) not in h.prefixes for j in range(k + 1, MAX_TOKENS + 1))


def test_backs_up_nothing_on_a_clean_boundary_and_never_a_special_token(tokenizer):
    h = healer(tokenizer)
    assert h.backup(tokenizer.encode(CLEAN)) == 0
    assert h.backup(tokenizer.encode(SPACE) + [tokenizer.eos_token_id]) == 0
    assert h.backup(tokenizer.encode(" ")) == 0  # the first token stays


# -- Model.generate(heal=True) -----------------------------------------------------------------------
def test_a_prompt_on_a_clean_boundary_is_generated_exactly_as_without_healing(make_model):
    m = make_model()
    (plain,), (healed,) = m.generate([CLEAN], max_tokens=8), m.generate([CLEAN], max_tokens=8, heal=True)
    assert healed.healed == "" and healed.healed_prompt_tokens == 0
    assert (healed.text, healed.token_ids, healed.prompt_tokens) == (plain.text, plain.token_ids, plain.prompt_tokens)


def test_heal_regenerates_the_backed_up_text_and_the_value_excludes_it(make_model, tokenizer):
    m = make_model()
    ids = tokenizer.encode(MID_WORD)
    (c,) = m.generate([MID_WORD], max_tokens=6, heal=True, ignore_eos=True)
    assert c.healed == "pi" and c.healed_prompt_tokens == 2 and c.prompt_tokens == len(ids) - 2
    assert tokenizer.decode(c.token_ids) == "pi" + c.text  # the generated ids spell the backed-up text, then the value
    assert tokenizer.decode(ids[:-2] + c.token_ids) == MID_WORD + c.text
    assert len(value_tokens(c)) == 6 and c.finish_reason == "length"  # max_tokens counts the value's tokens


def test_healed_greedy_output_equals_the_uncached_reference_cold_and_warm(make_model, llama, tokenizer):
    m = make_model()
    ids = tokenizer.encode(MID_WORD)
    h = healer(tokenizer)
    (cold,) = m.generate([MID_WORD], max_tokens=10, heal=True, ignore_eos=True)
    (warm,) = m.generate([MID_WORD], max_tokens=10, heal=True, ignore_eos=True)
    assert warm.cached_tokens > 0 and (warm.text, warm.token_ids) == (cold.text, cold.token_ids)
    prompt = ids[:-2]
    with torch.inference_mode():  # the first token: the most likely of those agreeing with the backed-up text
        logits = llama(input_ids=torch.tensor([prompt])).logits[0, -1]
    agreeing = h.agreeing(b"pi")
    first = int(torch.argmax(logits[:agreeing.numel()].masked_fill(~agreeing, float("-inf"))))
    assert cold.token_ids[0] == first
    spelled = next(j for j in range(1, len(cold.token_ids) + 1)
                   if len(b"".join(h.pieces[t] for t in cold.token_ids[:j])) >= 2)
    rest = cold.token_ids[spelled:]  # after the backed-up text: unconstrained greedy decoding
    assert rest == reference_greedy(llama, prompt + cold.token_ids[:spelled], len(rest), None)
    m.check_integrity()


def test_stop_strings_and_stop_fn_see_the_value_not_the_backed_up_text(make_model):
    m = make_model()
    seen = []

    def stop_fn(ids, text):
        seen.append((list(ids), text))
        return False

    (c,) = m.generate([SPACE], max_tokens=8, min_tokens=1, stop=[" "], heal=True)
    assert c.healed == " " and len(value_tokens(c)) >= 1 and " " not in c.text  # " " in the healed text did not stop
    (d,) = m.generate([SPACE], max_tokens=5, heal=True, stop_fn=stop_fn, ignore_eos=True)
    assert seen[-1] == (value_tokens(d), d.text)
    assert all(len(ids) <= 5 for ids, _ in seen)


def test_min_and_max_tokens_count_the_tokens_that_carry_the_value(make_model):
    m = make_model()
    for prompt in (MID_WORD, SPACE):
        (c,) = m.generate([prompt], min_tokens=4, max_tokens=4, heal=True)
        assert len(value_tokens(c)) == 4 and c.finish_reason == "length"


def test_healed_choices_come_out_in_the_canonical_tokenization_of_backed_up_text_and_choice(make_model, tokenizer):
    m = make_model()
    ids = tokenizer.encode(MID_WORD)
    for _ in range(2):
        (c,) = m.generate([MID_WORD], choices=["tal", "ece", "ne"], heal=True)
        assert c.text in ("tal", "ece", "ne") and c.healed == "pi"
        assert c.token_ids == tokenizer.encode("pi" + c.text)
        assert ids[:-2] + c.token_ids == tokenizer.encode(MID_WORD + c.text)


def test_regex_json_and_lark_constraints_compose_with_healing(make_model):
    m = make_model()
    (c,) = m.generate([MID_WORD], regex=r"[a-z]+ [a-z]+\.", heal=True, max_tokens=20)
    assert c.healed == "pi" and re.fullmatch(r"[a-z]+ [a-z]+\.", c.text)
    (c,) = m.generate([SPACE], json_schema={"type": "integer"}, heal=True, max_tokens=6)
    assert c.healed == " " and re.fullmatch(r"-?[0-9]+", c.text)
    lark = 'start: VALUE\nVALUE: /[a-z]{3,6}/ & ~/(?s:.*)q(?s:.*)/'
    (c,) = m.generate([MID_WORD], grammar=lark, heal=True, max_tokens=8)
    assert re.fullmatch(r"[a-pr-z]{3,6}", c.text)


def test_a_healed_stream_yields_the_value_without_the_backed_up_text(make_model):
    import asyncio

    m = make_model()

    async def streamed():
        chunks = [c async for c in m.stream(MID_WORD, max_tokens=6, heal=True, ignore_eos=True, stop=["e"])]
        return "".join(c.text for c in chunks), chunks[-1].completion

    text, last = asyncio.run(streamed())
    (c,) = m.generate([MID_WORD], max_tokens=6, heal=True, ignore_eos=True, stop=["e"])
    assert text == last.text == c.text and last.healed == "pi" and last.token_ids == c.token_ids


def test_heal_refuses_a_python_mask_and_grammar_prefix(make_model):
    m = make_model()
    with pytest.raises(ValueError, match="heal=True does not combine"):
        m.generate([MID_WORD], heal=True, mask=lambda ids: None)
    with pytest.raises(ValueError, match="heal=True does not combine"):
        m.generate([MID_WORD], heal=True, regex="[a-z]+", grammar_prefix=1)


# -- queries -----------------------------------------------------------------------------------------
def test_HEAL_heals_its_hole_and_the_prompt_text_is_unchanged(make_model, tokenizer):
    m = make_model()
    result, trace = run(m, f'''
argmax
    "{MID_WORD}[X]" where HEAL(X) and len(TOKENS(X)) < 4
    " then[Y]" where len(TOKENS(Y)) < 3
    return X, Y
''')
    x, y = result
    (c,) = m.generate([MID_WORD], max_tokens=3, heal=True)
    assert x == c.text  # the value excludes the backed-up "pi"
    assert "".join(t.text for t in trace.tokens) == MID_WORD + x + " then" + y
    ids = [t.id for t in trace.tokens]
    assert ids[:len(tokenizer.encode(MID_WORD)) - 2] == tokenizer.encode(MID_WORD)[:-2]
    assert [t.id for t in trace.tokens if t.hole == "X"] == c.token_ids  # "pi" was generated again, by X
    # the row counts what the trace marks as X's: the value's tokens and the two re-generating "pi"
    assert (trace.holes[0].tokens, trace.holes[0].healed) == (len(c.token_ids), 2) and len(value_tokens(c)) <= 3


def test_a_healed_hole_obeys_STOPS_AT_and_its_token_bounds(make_model, tokenizer):
    m = make_model()
    for prompt in (SPACE, MID_WORD):
        result, trace = run(m, f'''
argmax
    "{prompt}[X]" where HEAL(X) and STOPS_AT(X, " ") and len(TOKENS(X)) < 5 and len(TOKENS(X)) > 1
    return X
''')
        hole = trace.holes[0]  # its row counts also the tokens re-generating the backed-up text: not the value's
        backed = tokenizer.decode(tokenizer.encode(prompt)[-hole.healed:]).encode() if hole.healed else b""
        size, inside = 0, 0
        for t in (t for t in trace.tokens if t.hole == "X"):
            size += len(t.text.encode())
            if size > len(backed):
                break
            inside += 1
        n = hole.tokens - inside
        assert 2 <= n <= 4
        assert result.count(" ") <= 1 and (result.endswith(" ") or n == 4)


def test_a_healed_choice_is_exactly_one_of_the_choices(make_model, tokenizer):
    m = make_model()
    result, trace = run(m, f'''
argmax
    "{MID_WORD}[X]" where HEAL(X) and X in ["tal", "ece", "ne"]
    return X
''')
    assert result in ("tal", "ece", "ne")
    assert [t.id for t in trace.tokens] == tokenizer.encode(MID_WORD + result)


def test_the_token_healing_decoder_option_heals_every_hole(make_model):
    m = make_model()
    body = f'''
    "{MID_WORD}[X]" where len(TOKENS(X)) < 4{{}}
    " the[Y]" where len(TOKENS(Y)) < 4{{}}
    return X, Y
'''
    healed, t1 = run(m, "argmax(token_healing=True)" + body.format("", ""))
    by_hole, t2 = run(m, "argmax" + body.format(" and HEAL(X)", " and HEAL(Y)"))
    plain, t3 = run(m, "argmax" + body.format("", ""))
    assert healed == by_hole and [t.id for t in t1.tokens] == [t.id for t in t2.tokens]
    spelled = lambda trace, hole: "".join(t.text for t in trace.tokens if t.hole == hole)  # noqa: E731
    assert spelled(t1, "X") == "pi" + healed[0] and spelled(t3, "X") == plain[0]  # X generated "pi" again
    assert spelled(t1, "Y") == " the" + healed[1] and spelled(t3, "Y") == plain[1]


def test_holes_without_healing_are_unchanged_next_to_a_healed_one(make_model):
    m = make_model()
    source = f'''
argmax
    "{SPACE}[X]" where len(TOKENS(X)) < 4
    " {MID_WORD}[Y]" where len(TOKENS(Y)) < 4{{}}
    return X
'''
    (x1, _), (x2, _) = run(m, source.format("")), run(m, source.format(" and HEAL(Y)"))
    assert x1 == x2


@pytest.mark.parametrize("source, match", [
    ('argmax\n    "a b[X]" where HEAL(X) or STOPS_AT(X, ".")\n    return X', "HEAL"),
    ('beam(n=2)\n    "a b[X]" where HEAL(X) and len(TOKENS(X)) < 3\n    return X', "token healing"),
])
def test_healing_that_cannot_be_enforced_is_an_error_naming_it(make_model, source, match):
    with pytest.raises(kvql.QueryError, match=match):
        run(make_model(), source)


def test_token_healing_must_be_a_bool(make_model):
    with pytest.raises(ValueError, match="token_healing"):
        run(make_model(), 'argmax(token_healing="yes")\n    "a b[X]" where len(TOKENS(X)) < 3\n    return X')


def test_heal_on_a_remote_model_is_refused_by_name_before_sending(served, tokenizer):
    url, _ = served
    for tok in (tokenizer, False):
        remote = kvql.model(url + "/v1", tokenizer=tok)
        with pytest.raises(Unsupported, match=f"token healing.*{re.escape(url)}"):
            remote.generate([MID_WORD], max_tokens=3, heal=True)
        with pytest.raises(kvql.QueryError, match=f"token healing of X.*{re.escape(url)}"):
            run(remote, f'argmax\n    "{MID_WORD}[X]" where HEAL(X) and len(TOKENS(X)) < 3\n    return X')
        remote.close()


# -- SmolLM2: the model's own tokens ---------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    m = kvql.model("smollm2-135m", dtype="float32", cache_budget="256MB")
    yield m
    m.close()


def joined_ids(m, prompt: str, c) -> list[int]:
    ids = m.tokenizer.encode(prompt)
    return ids[:len(ids) - c.healed_prompt_tokens] + c.token_ids


@pytest.mark.smollm2
@pytest.mark.parametrize("prompt, healed", [
    ("Q: Is Paris in Europe?\nA: ", " "),                          # a trailing space
    ("Q: What is the capital of France?\nA: The capi", " capi"),   # a partial word
    ("To search the web, go to http://www.goo", "goo"),            # a partial URL
])
def test_healing_gives_the_models_natural_tokens_across_the_prompts_end(smol, prompt, healed):
    (plain,) = smol.generate([prompt], max_tokens=5)
    (c,) = smol.generate([prompt], max_tokens=5, heal=True)
    assert c.healed == healed
    first = smol.tokenizer.decode(c.token_ids[:1])
    assert first.startswith(healed) and len(first) > len(healed)  # one token spans the boundary
    assert joined_ids(smol, prompt, c) == smol.tokenizer.encode(prompt + c.text)
    assert joined_ids(smol, prompt, plain) != smol.tokenizer.encode(prompt + plain.text) or plain.text != c.text


@pytest.mark.smollm2
def test_on_a_clean_boundary_healing_changes_neither_ids_nor_value(smol):
    prompt = "Q: What is the capital of France?\nA:"
    (plain,), (c,) = smol.generate([prompt], max_tokens=6), smol.generate([prompt], max_tokens=6, heal=True)
    assert c.text == plain.text
    assert joined_ids(smol, prompt, c) == smol.tokenizer.encode(prompt) + plain.token_ids


@pytest.mark.smollm2
def test_readme_yes_no_after_a_space_is_the_models_own_yes_token(smol):
    tok = smol.tokenizer
    source = '''
argmax
    "Q: What is the capital of France?\\nA: Paris\\n"
    "Q: What is the capital of Italy?\\nA:[ANSWER]" where STOPS_BEFORE(ANSWER, "\\n") and len(TOKENS(ANSWER)) < 10
    "\\nQ: Is it in Europe?\\nA: [YN]" where YN in ["yes", "no"]{}
    return ANSWER.strip(), YN
'''
    (_, plain), t_plain = run(smol, source.format(""))
    (_, healed), t_healed = run(smol, source.format(" and HEAL(YN)"))
    assert plain in ("yes", "no") and healed in ("yes", "no")
    assert [t.id for t in t_plain.tokens[-2:]] == [tok.encode(" ")[0], tok.encode(plain)[0]]  # " " + "yes"
    (own,) = tok.encode(" " + healed)
    assert t_healed.tokens[-1].id == own and t_healed.tokens[-1].hole == "YN"  # the model's own " yes" token
    assert t_healed.tokens[-2].text == ":"


@pytest.mark.parametrize("heal", [False, True])
def test_a_choice_that_is_a_special_tokens_text_is_refused_before_generating(make_model, heal):
    # llguidance matches such a choice with the special token itself; the end-of-sequence token then ends the
    # output without text, a value that is none of the choices (issue 25)
    m = make_model()
    before = m.stats()["generated_tokens"]
    for choices in (["<eos>"], [" yes", "say <eos> now"]):
        with pytest.raises(ValueError, match="special token '<eos>'"):
            m.generate(["Answer: "], choices=choices, heal=heal, max_tokens=8)
    assert m.stats()["generated_tokens"] == before
    c = m.generate(["Answer: "], choices=[" yes", " no"], heal=heal, max_tokens=8)[0]
    assert c.text in (" yes", " no")
    m.check_integrity()


@pytest.mark.parametrize("constraint", [{"regex": r"[^\s\S]"}, {"grammar": "start: A\nA: /a/ & /b/"},
                                        {"json_schema": {"type": "object", "required": ["a"],
                                                         "properties": {"a": False}}}])
def test_a_constraint_that_accepts_nothing_is_refused_before_generating_when_healed(make_model, constraint):
    # inside the healed grammar (backed-up text, then the value) an empty constraint compiles, and failed only
    # after the backed-up text was generated (issue 25): it is compiled alone first, and named as given
    m = make_model()
    before = m.stats()["generated_tokens"]
    (kind, value), = constraint.items()
    with pytest.raises(ValueError, match="accepts no text at all|[Uu]nsatisfiable") as e:
        m.generate([SPACE], heal=True, max_tokens=8, **constraint)
    assert "healed_value" not in str(e.value) and kind.split("_")[0] in str(e.value).lower()
    assert m.stats()["generated_tokens"] == before
    m.check_integrity()
