"""Grammars compiled to token masks: a random model's output obeys each constraint kind, greedy and
sampled; completion ends with "stop"; bad constraints fail clearly; masks follow any history."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvql.engine.decode.grammar import MAX_BYTES, Grammar

PROMPTS = ["Question: what is the capital of France? Answer:", "Once upon a time", "def add(a, b):"]
SEEDS = (0, 1)


def generate_all(m, grammar, max_tokens=40, seeds=SEEDS):
    """Greedy on every prompt, then 3 samples per prompt sharing one mask function, for each seed."""
    out = m.generate(PROMPTS, max_tokens=max_tokens, mask=grammar.mask_fn())
    for seed in seeds:
        out += m.generate(PROMPTS, max_tokens=max_tokens, mask=grammar.mask_fn(), temperature=1.0, n=3,
                          seed=seed)
    assert len(out) == len(PROMPTS) * (1 + 3 * len(seeds))
    assert all(c.finish_reason == "stop" for c in out), [(c.text, c.finish_reason) for c in out]
    return [c.text for c in out]


@pytest.fixture
def m(make_model):
    return make_model()


def test_regex_output_fullmatches(m, tokenizer):
    pattern = r"[0-9]{1,3}-(red|green|blue) [a-z]{2,5}\."
    texts = generate_all(m, Grammar.regex(tokenizer, pattern))
    assert all(re.fullmatch(pattern, t) for t in texts), texts
    assert len(set(texts)) > 3  # sampling explores the language


def test_choices_output_is_exactly_one_option(m, tokenizer):
    options = ["yes", "yesterday", "no", "Paris.", "Par", " the lazy dog", "maybe not", "日本"]
    texts = generate_all(m, Grammar.choices(tokenizer, options))
    assert all(t in options for t in texts), texts
    assert len(set(texts)) > 2


def test_json_schema_output_parses_and_has_the_required_keys_and_types(m, tokenizer):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
            "color": {"enum": ["red", "green"]},
        },
        "required": ["name", "age", "ok", "color"],
        "additionalProperties": False,
    }
    texts = generate_all(m, Grammar.json_schema(tokenizer, schema), max_tokens=80, seeds=(0,))
    for text in texts:
        obj = json.loads(text)
        assert set(obj) == {"name", "age", "ok", "color"}, text
        assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
        assert type(obj["age"]) is int and 0 <= obj["age"] <= 120
        assert isinstance(obj["ok"], bool) and obj["color"] in ("red", "green")
    from_text = Grammar.json_schema(tokenizer, json.dumps(schema))  # the schema's JSON text works the same
    greedy = m.generate(PROMPTS, max_tokens=80, mask=from_text.mask_fn())
    assert [c.text for c in greedy] == texts[:len(PROMPTS)]


def test_lark_output_is_in_the_language(m, tokenizer):
    grammar = 'start: greeting " " NAME "!"\ngreeting: "hello" | "hi" | "hey there"\nNAME: /[A-Z][a-z]{1,5}/'
    texts = generate_all(m, Grammar.lark(tokenizer, grammar))
    assert all(re.fullmatch(r"(hello|hi|hey there) [A-Z][a-z]{1,5}!", t) for t in texts), texts


def test_regex_intersection_and_negation(m, tokenizer):
    both = Grammar.regex_all(tokenizer, [r"[a-d]{2,8}", r".*c.*", r"(..)+"])
    texts = generate_all(m, both)
    assert all(re.fullmatch(r"[a-d]{2,8}", t) and "c" in t and len(t) % 2 == 0 for t in texts), texts
    without_ab = Grammar.lark(tokenizer, "start: MATCH\nMATCH: /[a-c]{3,6}/ & ~/(?s:.*)ab(?s:.*)/")
    texts = generate_all(m, without_ab)
    assert all(re.fullmatch(r"[a-c]{3,6}", t) and "ab" not in t for t in texts), texts


def test_a_grammar_is_shared_between_concurrent_requests(m, tokenizer):
    grammar = Grammar.choices(tokenizer, ["alpha", "beta", "gamma"])
    out = m.generate(PROMPTS * 4, max_tokens=10, mask=grammar.mask_fn(), temperature=1.0, n=2, seed=7)
    assert all(c.text in ("alpha", "beta", "gamma") and c.finish_reason == "stop" for c in out)


def allowed_ids(mask: torch.Tensor) -> set[int]:
    return set(mask.nonzero().flatten().tolist())


def test_mask_offers_every_tokenization_at_choices_and_only_eos_once_complete(tokenizer):
    eos = tokenizer.eos_token_id
    options = ["yes", "yesterday", "Paris", "no", "nothing"]
    grammar = Grammar.choices(tokenizer, options)
    mask = grammar.mask_fn()
    first = mask([])
    assert first.dtype == torch.bool and first.shape == (len(tokenizer),) == (grammar.vocab_size,)
    pieces = {t: tokenizer.decode([t]) for t in range(len(tokenizer)) if t != eos}
    assert allowed_ids(first) == {t for t, s in pieces.items() if s and any(o.startswith(s) for o in options)}
    # Any tokenization is accepted as history; bytes the grammar forces are offered canonically.
    by_char = tokenizer.convert_tokens_to_ids(list("Paris"))  # byte-level BPE: one token per ASCII char
    canonical = tokenizer.encode("Paris")
    assert by_char != canonical and tokenizer.decode(canonical[1:]) == "ris"
    assert allowed_ids(mask(by_char[:2])) == {canonical[1]}
    assert allowed_ids(mask(by_char)) == allowed_ids(mask(canonical)) == {eos}  # complete: only EOS
    after_no = allowed_ids(mask(tokenizer.encode("no")))  # complete, but "nothing" may continue
    assert after_no == {eos, tokenizer.encode("thing")[0]}


def test_mask_follows_non_monotonic_histories(tokenizer):
    grammar = Grammar.regex(tokenizer, r"(the|a) (quick|lazy) (fox|dog)s?")
    shared = grammar.mask_fn()
    long = tokenizer.encode("the quick fox")
    short_other = tokenizer.encode("a lazy")
    for history in (long, short_other, long[:2], [], long, long[:1], short_other[:1], long):
        assert torch.equal(shared(history), grammar.mask_fn()(history)), history


def valid_histories(tokenizer):
    """Prefixes of tokenizations (canonical or one token per character) of strings in the language."""
    texts = ["the quick fox", "a lazy dogs", "the lazy dog", "a quick foxs"]
    by_char = [tokenizer.convert_tokens_to_ids(list(t.replace(" ", "Ġ"))) for t in texts]  # "Ġ": byte-level space
    tokenizations = [tokenizer.encode(t) for t in texts] + by_char
    return st.sampled_from(tokenizations).flatmap(lambda ids: st.integers(0, len(ids)).map(lambda k: ids[:k]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_shared_mask_equals_a_fresh_one_for_any_sequence_of_histories(tokenizer, data):
    grammar = Grammar.regex(tokenizer, r"(the|a) (quick|lazy) (fox|dog)s?")
    shared = grammar.mask_fn()
    for history in data.draw(st.lists(valid_histories(tokenizer), min_size=1, max_size=8)):
        assert torch.equal(shared(history), grammar.mask_fn()(history)), history


def test_a_rejected_history_raises_and_the_mask_recovers(tokenizer):
    mask = Grammar.choices(tokenizer, ["yes", "no"]).mask_fn()
    good = mask(tokenizer.encode("ye"))
    with pytest.raises(ValueError, match="doesn't satisfy the grammar"):
        mask(tokenizer.encode("yo"))
    assert torch.equal(mask(tokenizer.encode("ye")), good)


def test_a_rejected_history_fails_the_request_with_the_grammar_error(m, tokenizer):
    grammar = Grammar.choices(tokenizer, ["yes", "no"])
    mask = grammar.mask_fn()
    bad = lambda ids: mask(tokenizer.encode("x") + ids)  # noqa: E731
    with pytest.raises(ValueError, match="grammar error after 1 generated tokens"):
        m.generate(["Once"], max_tokens=4, mask=bad)
    (c,) = m.generate(["Once"], max_tokens=4, mask=grammar.mask_fn())
    assert c.text in ("yes", "no") and c.finish_reason == "stop"


@pytest.mark.parametrize("build, named, problem", [
    (lambda tok: Grammar.regex(tok, "a(b"), "a(b", "unclosed group"),
    (lambda tok: Grammar.regex_all(tok, ["[a-z]+", "x)"]), "x)", "unopened group"),
    (lambda tok: Grammar.json_schema(tok, {"type": "foo"}), '"type": "foo"', "Invalid type: foo"),
    (lambda tok: Grammar.json_schema(tok, '{"type": "object"'), '{"type": "object"', "not JSON (Expecting"),
    (lambda tok: Grammar.json_schema(tok, {"type": "string", "format": "weird"}), "weird", "Unknown format"),
    (lambda tok: Grammar.lark(tok, "start: foo"), "start: foo", 'unknown name: "foo"'),
    (lambda tok: Grammar.lark(tok, 'start: "a" | ('), 'start: "a" | (', "Expected token ')'"),
])
def test_invalid_constraints_raise_value_error_naming_input_and_problem(tokenizer, build, named, problem):
    with pytest.raises(ValueError) as e:
        build(tokenizer)
    message = str(e.value)
    assert message.startswith("invalid ") and named in message and problem in message, message


def test_empty_choices_and_patterns_are_rejected(tokenizer):
    with pytest.raises(ValueError, match="at least one option"):
        Grammar.choices(tokenizer, [])
    with pytest.raises(ValueError, match="at least one pattern"):
        Grammar.regex_all(tokenizer, [])


def _lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def _ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "maxLength": 3}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.mark.parametrize("build", [
    lambda tok: Grammar.lark(tok, _lark_chain(3000)),   # segfaulted the process in the compiler
    lambda tok: Grammar.json_schema(tok, _ref_chain(3000)),
    lambda tok: Grammar.lark(tok, _lark_chain_within_limit()),  # the deepest chain the size limit lets in
])
def test_deep_grammars_compile_without_crashing_the_process(tokenizer, build):
    mask = build(tokenizer).mask_fn()
    assert mask([]).any()


def _lark_chain_within_limit() -> str:
    lines, size, i = ["start: a0\n"], 10, 0
    while True:
        line = f"a{i:x}: a{i + 1:x}\n"
        if size + len(line) + 16 > MAX_BYTES:
            break
        lines.append(line)
        size += len(line)
        i += 1
    lines.append(f'a{i:x}: "a"\n')
    return "".join(lines)


def test_oversize_and_overdeep_constraints_are_refused_before_compiling(tokenizer):
    with pytest.raises(ValueError, match=f"at most {MAX_BYTES} bytes"):
        Grammar.lark(tokenizer, _lark_chain(40_000))
    with pytest.raises(ValueError, match=f"at most {MAX_BYTES} bytes"):
        Grammar.regex(tokenizer, "a" * (MAX_BYTES + 1))
    nested: dict = {"type": "string"}
    for _ in range(600):
        nested = {"type": "object", "properties": {"a": nested}}
    with pytest.raises(ValueError, match="nested 1201 deep"):
        Grammar.json_schema(tokenizer, nested)
    text = '{"type": "array", "items": ' * 100_000 + "{}" + "}" * 100_000
    with pytest.raises(ValueError, match="bytes"):
        Grammar.json_schema(tokenizer, text)
    with pytest.raises(TypeError, match="must be a string"):
        Grammar.regex(tokenizer, 5)


def test_a_crash_in_the_compiler_refuses_the_constraint_and_spares_the_process(tokenizer, monkeypatch):
    import llguidance
    from kvql.engine.decode import grammar_sandbox
    text = llguidance.LLMatcher.grammar_from_lark(_lark_chain(3000))
    # a 1 MiB stack in the sandbox: this chain overflows it there, a real SIGSEGV in the child
    monkeypatch.setattr(grammar_sandbox, "STACK_BYTES", 1 << 20)
    with pytest.raises(ValueError, match="crashed llguidance's grammar compiler"):
        grammar_sandbox.check(tokenizer, text)
    monkeypatch.undo()
    assert grammar_sandbox.check(tokenizer, text) is None  # a new child, with the big stack
    assert Grammar.regex(tokenizer, "[a-z]+").mask_fn()([]).any()


def test_a_compile_over_the_time_limit_is_refused(tokenizer):
    import llguidance
    from kvql.engine.decode import grammar_sandbox
    with pytest.raises(ValueError, match="took longer than 0.001 s"):
        grammar_sandbox.check(tokenizer, llguidance.LLMatcher.grammar_from_regex("(a{1000}){1000}"), timeout=0.001)
    assert Grammar.regex(tokenizer, "[a-z]+").mask_fn()([]).any()


def test_a_constraint_text_is_compiled_once_per_tokenizer(tokenizer, monkeypatch):
    """The second Grammar of the same text skips the sandbox and the compile, and masks as the first does;
    an invalid text's error is remembered too (a client repeating it costs no compile)."""
    from kvql.engine.decode import grammar as grammar_module

    checks = []
    real = grammar_module.grammar_sandbox.check
    monkeypatch.setattr(grammar_module.grammar_sandbox, "check", lambda tok, text: checks.append(text) or real(tok, text))
    pattern = r"[0-9]{3}-cached-once"
    a, b = Grammar.regex(tokenizer, pattern), Grammar.regex(tokenizer, pattern)
    assert len(checks) == 1
    digits = tokenizer.encode("12", add_special_tokens=False)
    assert torch.equal(a.mask_fn()(digits), b.mask_fn()(digits))
    assert torch.equal(a.mask_fn()([]), b.mask_fn()(digits[:0]))
    for _ in range(2):
        with pytest.raises(ValueError, match="unclosed group"):
            Grammar.regex(tokenizer, "(cached-error")
    assert len(checks) == 2


@pytest.mark.parametrize("constraint", [{"regex": "ab"}, {"choices": ["yes", "no"]}, {"grammar": 'start: "x" "y"'}])
def test_ignore_eos_under_a_constraint_ends_at_the_grammars_end(make_model, constraint):
    # it used to generate the whole value, then fail: "grammar error after 2 generated tokens: parser stopped"
    m = make_model()
    (c,) = m.generate([[5, 6, 7]], max_tokens=12, ignore_eos=True, **constraint)
    assert c.finish_reason == "stop" and c.text in ("ab", "yes", "no", "xy")
    m.check_integrity()


def test_the_json_spacing_above_the_engine_is_the_engines():
    # two definitions because the engine imports nothing of the contract: they must not drift apart
    from kvql.backends.options import JSON_SPACING
    from kvql.engine.decode.grammar import JSON_SPACING as ENGINE
    assert JSON_SPACING == ENGINE


def test_the_sandbox_compiles_a_constraint_while_others_hold_its_children(tokenizer):
    """A child busy with a slow constraint leaves the next one to another child; with every child busy,
    a check waits for the first one free."""
    import llguidance

    from kvql.engine.decode import grammar_sandbox as sandbox

    text = llguidance.LLMatcher.grammar_from_regex("[0-9]+")
    key = sandbox._tokenizer_json(tokenizer)[0]
    held = [sandbox._take(key) for _ in range(sandbox.CHILDREN - 1)]  # as if compiling slow constraints
    try:
        assert sandbox.check(tokenizer, text) is None  # the last child
        held.append(sandbox._take(key))
        done = threading.Event()
        waiter = threading.Thread(target=lambda: sandbox.check(tokenizer, text) is None and done.set())
        waiter.start()
        assert not done.wait(0.2)  # every child busy: it waits ...
        sandbox._give_back(held.pop(), alive=True)
        waiter.join()
        assert done.is_set()  # ... for the one given back
    finally:
        for child in held:
            sandbox._give_back(child, alive=True)
