"""vLLM 0.32's request fields on kvql serve, with vLLM's meaning: min_tokens, return_tokens_as_token_ids,
return_token_ids (also streamed), prompt_logprobs, echo with logprobs; token-id prompts and cache_salt
with them. A real server on loopback, the official `openai` client (vLLM's fields through extra_body)."""

from __future__ import annotations

import copy
import json
import re

import httpx
import pytest
import torch

import kvql
from kvql.server.app import create_app
from conftest import serving

TOKEN_ID = re.compile(r"token_id:(\d+)")


def post(served, body, path="/v1/completions"):
    return httpx.post(served[0] + path, json=body, timeout=60)


def events(served, body, path="/v1/completions"):
    with httpx.stream("POST", served[0] + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(e) for e in lines[:-1]]


@torch.inference_mode()
def reference_prompt_logprobs(hf_model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from one plain transformers forward."""
    logp = torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


# -- min_tokens ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eos_first(tokenizer, llama):
    """A server whose model's EOS is the token it greedily generates first after PROMPT: without
    min_tokens it answers nothing; the EOS id is also what it would pick later on."""
    prompt = "Once upon a time"
    probe = kvql.Model(llama, tokenizer, cache_budget=1 << 20)
    first = probe.generate([prompt], max_tokens=1)[0].token_ids[0]
    probe.close()
    hf = copy.deepcopy(llama)
    hf.config.eos_token_id = first
    model = kvql.Model(hf, tokenizer, name="tiny", cache_budget=1 << 20)
    with serving(create_app(model)) as url:
        yield url, model, prompt, first


def test_min_tokens_holds_off_eos_for_that_many_tokens(eos_first):
    url, model, prompt, eos = eos_first
    plain = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                      "return_token_ids": True}).json()["choices"][0]
    assert plain["token_ids"] == [] and plain["finish_reason"] == "stop"
    got = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                    "min_tokens": 4, "return_token_ids": True}).json()["choices"][0]
    assert len(got["token_ids"]) >= 4 and eos not in got["token_ids"][:4]

    def no_eos_first_4(ids):
        allowed = torch.ones(model.vocab_size, dtype=torch.bool)
        allowed[eos] = len(ids) >= 4
        return allowed
    want = model.generate([prompt], max_tokens=12, mask=no_eos_first_4)[0]
    assert got["token_ids"] == want.token_ids and got["text"] == want.text
    assert got["finish_reason"] == want.finish_reason


def test_min_tokens_with_a_grammar_keeps_the_grammar_and_bans_eos_below_it(client):
    body = {"structured_outputs": {"regex": "[0-9]{1,12}"}, "return_token_ids": True}
    plain = client.completions.create(model="tiny", prompt="Code:", max_tokens=16, temperature=0, extra_body=body)
    assert len(plain.choices[0].token_ids) == 1 and plain.choices[0].finish_reason == "stop"  # EOS after 1 digit
    out = client.completions.create(model="tiny", prompt="Code:", max_tokens=16, temperature=0,
                                    extra_body={**body, "min_tokens": 5})
    assert len(out.choices[0].token_ids) >= 5 and re.fullmatch("[0-9]{5,12}", out.choices[0].text)


def test_min_tokens_past_a_complete_grammar_lets_the_grammar_end_it_as_vllm(client):
    out = client.completions.create(model="tiny", prompt="Answer:", max_tokens=16, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["yes"]}, "min_tokens": 10})
    assert out.choices[0].text == "yes" and out.choices[0].finish_reason == "stop"


def test_stop_strings_count_only_after_min_tokens_as_vllm(served):
    url, model = served
    prompt, regex = "x", "[a-z ]{1,30}"  # the constraint keeps the random model's text readable
    full = model.generate([prompt], max_tokens=14, regex=regex)[0]
    pieces = [model.tokenizer.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    assert pieces[-1] == full.text
    stop = next(full.text[i:i + 2] for i in range(len(full.text)) if full.text.count(full.text[i:i + 2]) >= 2)
    early = full.text.index(stop)
    min_tokens = next(i for i, p in enumerate(pieces) if len(p) > early)  # its first occurrence is within them
    # vLLM: a stop string counts only where it ends after the text of the first min_tokens tokens
    later = full.text.find(stop, len(pieces[min_tokens]) - len(stop) + 1)
    assert later > early
    body = {"prompt": prompt, "max_tokens": 14, "temperature": 0, "stop": [stop], "return_token_ids": True,
            "structured_outputs": {"regex": regex}}

    cut_early = post(served, body).json()["choices"][0]
    assert cut_early["text"] == full.text[:early] and cut_early["stop_reason"] == stop
    got = post(served, {**body, "min_tokens": min_tokens}).json()["choices"][0]
    assert got["text"] == full.text[:later] and got["stop_reason"] == stop and got["finish_reason"] == "stop"
    assert got["token_ids"] == full.token_ids[:len(got["token_ids"])]
    assert len(pieces[len(got["token_ids"])]) >= later + len(stop)  # it ended on the token completing the stop

    chunks = events(served, {**body, "min_tokens": min_tokens})
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == got["text"]  # the stop string never went out, even held back
    assert [t for c in choices for t in c["token_ids"]] == got["token_ids"]
    assert choices[-1]["finish_reason"] == got["finish_reason"] and choices[-1]["stop_reason"] == got["stop_reason"]


def test_min_tokens_on_chat_holds_off_the_end(served):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0,
            "structured_outputs": {"regex": "[0-9]{1,12}"}, "return_token_ids": True}
    plain = post(served, body, "/v1/chat/completions").json()["choices"][0]
    assert plain["finish_reason"] == "stop" and len(plain["token_ids"]) < 10  # the constraint's end came first
    want = len(plain["token_ids"]) + 2
    got = post(served, {**body, "min_tokens": want}, "/v1/chat/completions").json()["choices"][0]
    assert len(got["token_ids"]) >= want and re.fullmatch("[0-9]+", got["message"]["content"])


def test_min_tokens_means_the_same_from_python_and_over_http(served):
    """One rule (kvql.engine.decode.masks, the detokenizer's stops): the Python API answers as the server does."""
    url, model = served
    full = model.generate(["x"], max_tokens=14, regex="[a-z ]{1,30}")[0]
    stop = next(full.text[i:i + 2] for i in range(len(full.text)) if full.text.count(full.text[i:i + 2]) >= 2)
    cases = [dict(max_tokens=16, min_tokens=10, choices=["yes"]),  # a complete grammar ends it early
             dict(max_tokens=14, min_tokens=3, regex="[a-z ]{1,30}", stop=[stop]),  # stops count after 3 tokens
             dict(max_tokens=8, min_tokens=5, logit_bias={"7": -100})]
    for opts in cases:
        (local,) = model.generate(["x"], **opts)
        body = {"prompt": "x", "temperature": 0, "return_token_ids": True,
                **{k: v for k, v in opts.items() if k not in ("choices", "regex")}}
        if "choices" in opts:
            body["structured_outputs"] = {"choice": opts["choices"]}
        if "regex" in opts:
            body["structured_outputs"] = {"regex": opts["regex"]}
        remote = post(served, body).json()["choices"][0]
        assert (remote["text"], remote["token_ids"], remote["finish_reason"], remote["stop_reason"]) == \
            (local.text, local.token_ids, local.finish_reason, local.stop_reason), opts
        assert "logit_bias" not in opts or 7 not in local.token_ids


@pytest.mark.parametrize("body, words", [
    ({"prompt": "x", "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ({"prompt": "x", "max_tokens": 3, "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "max_tokens": 3, "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "max_tokens": 3, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "echo"),
])
def test_out_of_range_vllm_fields_are_400_naming_them(served, body, words):
    r = post(served, body)
    assert r.status_code == 400 and words in r.json()["error"]["message"]


# -- token ids and logprobs ------------------------------------------------------------------------

def test_return_tokens_as_token_ids_spells_every_token_by_id(client):
    kw = dict(model="tiny", prompt="Question:", max_tokens=6, temperature=0, logprobs=3)
    plain = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    by_id = client.completions.create(**kw, extra_body={"return_token_ids": True,
                                                        "return_tokens_as_token_ids": True}).choices[0]
    assert by_id.text == plain.text
    assert by_id.logprobs.tokens == [f"token_id:{t}" for t in plain.token_ids]
    assert by_id.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    for step, (token, top) in enumerate(zip(by_id.logprobs.tokens, by_id.logprobs.top_logprobs)):
        assert all(TOKEN_ID.fullmatch(k) for k in top) and token in top  # the chosen token and the best 3
        assert 3 <= len(top) <= 4 and top[token] == by_id.logprobs.token_logprobs[step]
        # by text, tokens that decode alike ("\ufffd" for partial bytes) collide; by id, none is lost
        text_top = plain.logprobs.top_logprobs[step]
        assert len(top) >= len(text_top)
        assert all(min(abs(v - w) for w in top.values()) < 1e-5 for v in text_top.values())
    offsets = by_id.logprobs.text_offset
    assert offsets == [sum(len(t) for t in by_id.logprobs.tokens[:i]) for i in range(len(offsets))]


def test_chat_logprobs_with_token_ids(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}], max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = out.choices[0]
    content = choice.logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in choice.token_ids]
    for c in content:
        assert len(c.top_logprobs) == 2 and all(TOKEN_ID.fullmatch(a.token) for a in c.top_logprobs)
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= -9999
        assert c.bytes == list(c.token.encode())


def test_streamed_token_ids_add_up_to_the_plain_ones(served):
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0, "seed": 5, "n": 2,
            "return_token_ids": True}
    plain = post(served, body).json()["choices"]
    chunks = [c for e in events(served, body) for c in e["choices"]]
    prompt_ids = served[1].tokenizer.encode("Once upon a time")
    for sample in (0, 1):
        mine = [c for c in chunks if c["index"] == sample]
        assert [t for c in mine for t in c["token_ids"]] == plain[sample]["token_ids"]
        assert "".join(c["text"] for c in mine) == plain[sample]["text"]
        assert mine[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in mine[1:])


def test_streamed_logprobs_come_whole_with_the_last_chunk(served):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True, "return_token_ids": True}
    plain = post(served, body).json()["choices"][0]
    choices = [c["choices"][0] for c in events(served, body)]
    assert all(c["logprobs"] is None for c in choices[:-1])
    assert choices[-1]["logprobs"]["tokens"] == plain["logprobs"]["tokens"]
    assert choices[-1]["logprobs"]["token_logprobs"] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)


def test_streamed_chat_token_ids(served):
    body = {"messages": [{"role": "user", "content": "hey"}], "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}
    plain = post(served, body, "/v1/chat/completions").json()
    stream = events(served, body, "/v1/chat/completions")
    assert [t for e in stream for t in e["choices"][0]["token_ids"]] == plain["choices"][0]["token_ids"]
    assert stream[0]["prompt_token_ids"] == plain["prompt_token_ids"]


# -- prompt logprobs and echo ---------------------------------------------------------------------

def test_prompt_logprobs_are_vllms_shape_and_the_models_values(served, llama):
    url, model = served
    prompt = "Question: what is the capital of France?"
    ids = model.tokenizer.encode(prompt)
    choice = post(served, {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}).json()["choices"][0]
    pl = choice["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    want = reference_prompt_logprobs(llama, ids)
    for i in range(1, len(ids)):
        step = {int(t): v for t, v in pl[i].items()}
        assert ids[i] in step and 3 <= len(step) <= 4
        assert step[ids[i]]["logprob"] == pytest.approx(want[i - 1], abs=1e-4)
        assert step[ids[i]]["decoded_token"] == model.tokenizer.decode([ids[i]])
        ranked = sorted(step.values(), key=lambda v: -v["logprob"])
        assert [v["rank"] for v in ranked[:3]] == [1, 2, 3]  # the top 3, ranked
        higher = sum(v["logprob"] > step[ids[i]]["logprob"] for v in step.values())
        if len(step) == 3:  # the actual token is among the top 3: its rank is exact
            assert step[ids[i]]["rank"] == 1 + higher
        else:  # beyond them: exact when among the engine's 20 best, else unknown (None)
            assert step[ids[i]]["rank"] is None or step[ids[i]]["rank"] > 3


def test_prompt_logprobs_of_a_token_id_prompt_with_cache_salt(served, llama):
    ids = served[1].tokenizer.encode("Once upon a time there was")
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0, "cache_salt": "tenant-a",
            "return_token_ids": True}
    first = post(served, body).json()
    plain = {k: v for k, v in body.items() if k != "prompt_logprobs"}
    cached = post(served, plain).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(ids) - 1  # the first request's prompt went into tenant-a's partition
    other = post(served, {**plain, "cache_salt": "tenant-b"}).json()["usage"]["prompt_tokens_details"]
    assert other["cached_tokens"] == 0
    again = post(served, body).json()  # scored again though cached: prompt logprobs are always computed
    for r in (first, again):
        choice = r["choices"][0]
        assert choice["prompt_token_ids"] == ids
        got = [next(iter(step.values()))["logprob"] for step in choice["prompt_logprobs"][1:]]
        assert got == pytest.approx(reference_prompt_logprobs(llama, ids), abs=1e-4)
        assert all(len(step) == 1 for step in choice["prompt_logprobs"][1:])  # k = 0: the actual token only


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt(client, served, llama):
    prompt = "The quick brown fox"
    ids = served[1].tokenizer.encode(prompt)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == prompt and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [served[1].tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(reference_prompt_logprobs(llama, ids), abs=1e-4)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])


def test_echo_with_logprobs_and_generation_covers_prompt_then_output(served):
    ids = served[1].tokenizer.encode("Once upon")
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    plain = post(served, body).json()["choices"][0]
    echoed = post(served, {**body, "echo": True}).json()["choices"][0]
    assert echoed["text"] == served[1].tokenizer.decode(ids) + plain["text"]
    assert echoed["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids + plain["token_ids"]]
    assert echoed["logprobs"]["token_logprobs"][len(ids):] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert echoed["token_ids"] == plain["token_ids"] and echoed["prompt_token_ids"] == ids
    chunks = [c["choices"][0] for c in events(served, {**body, "echo": True})]
    assert "".join(c["text"] for c in chunks) == echoed["text"]
    assert chunks[-1]["logprobs"]["tokens"] == echoed["logprobs"]["tokens"]
    assert chunks[-1]["logprobs"]["token_logprobs"][1:] == pytest.approx(echoed["logprobs"]["token_logprobs"][1:], abs=1e-5)


def test_sampling_fields_of_vllm_reach_the_engine(client, served):
    greedy = client.completions.create(model="tiny", prompt="Once upon", max_tokens=6, temperature=0)
    top1 = client.completions.create(model="tiny", prompt="Once upon", max_tokens=6, temperature=1.0, seed=1,
                                     extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text
    kw = dict(max_tokens=8, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3)
    out = client.completions.create(model="tiny", prompt="Once upon", temperature=0, max_tokens=8,
                                    frequency_penalty=0.5, presence_penalty=0.3,
                                    extra_body={"repetition_penalty": 1.5})
    assert out.choices[0].text == served[1].generate(["Once upon"], **kw)[0].text


def test_completion_top_logprobs_keep_alternatives_whose_text_collides():
    # two ids that decode to the same text (e.g. two halves of a character, both "\ufffd") were one entry
    from kvql.completion import TokenLogprob
    from kvql.server.logprobs import completion_logprobs

    class Same:
        def __call__(self, token_id):
            return {7: "a", 8: "\ufffd", 9: "\ufffd", 10: "a"}[token_id]

    entry = TokenLogprob(7, -0.1, {7: -0.1, 8: -1.0, 9: -2.0, 10: -3.0})
    top = completion_logprobs(Same(), [7], [entry], k=4)["top_logprobs"][0]
    assert top == {"a": -0.1, "\ufffd": -1.0, "token_id:9": -2.0, "token_id:10": -3.0}
