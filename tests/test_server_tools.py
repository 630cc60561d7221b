"""Tool calling on /v1/chat/completions (kvql.server.tools): `tools`, `tool_choice` (required, a named function,
auto, none), `parallel_tool_calls`, streamed and not, through chat templates that render tools and ones that
ignore them; the fields clients send beside them. A real server on loopback, the real `openai` client, and
LangChain's `bind_tools` / `with_structured_output` against a `kvql serve` subprocess of the embedded
SmolLM2-135M-Instruct."""

from __future__ import annotations

import copy
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

import kvql
from kvql.server.app import create_app
from kvql.server.closed_schema import closed
from kvql.server.tools import ToolCalling
from conftest import CHAT_TEMPLATE, free_port, serving, start_server, tiny_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "Question: what is the weather in Paris?"}]
# a template that renders tools and earlier calls, as Qwen's and Hermes' do (arguments as objects)
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}: {{ t.function.description }};"
    "{% endfor %}<|end|>{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
    "</tool_call>{% endfor %}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def long_llama(tokenizer):
    return tiny_model(tokenizer, "llama", max_position_embeddings=2048)  # the tiny tokenizer spells JSON long


@pytest.fixture(scope="module", params=["ignores tools", "renders tools"])
def server(request, tokenizer, long_llama):
    """(base URL, model, whether the template renders tools), once per kind of chat template."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT_TEMPLATE if request.param == "ignores tools" else TOOLS_TEMPLATE
    model = kvql.Model(long_llama, tok, name="tiny", cache_budget=16 << 20)
    with serving(create_app(model, max_tokens_cap=256)) as url:
        yield url, model, request.param == "renders tools"
    model.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)


def post(server, body, path="/v1/chat/completions"):
    return httpx.post(server[0] + path, json={"model": "tiny", **body}, timeout=120)


def valid_calls(calls, allowed=SCHEMAS) -> list[tuple[str, dict]]:
    """Each call's (name, arguments), asserting the name is a tool's and the arguments valid under its schema."""
    out = []
    for c in calls:
        name, args = c.function.name, json.loads(c.function.arguments)
        assert c.type == "function" and c.id.startswith("call_") and name in allowed
        jsonschema.validate(args, {**allowed[name], "additionalProperties": False})
        out.append((name, args))
    return out


# -- tool_choice ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_required_calls_name_a_tool_with_arguments_valid_under_its_schema(client, seed):
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=seed)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(valid_calls(choice.message.tool_calls)) >= 1


@pytest.mark.parametrize("seed", range(3))
def test_a_named_function_gives_its_arguments_valid_under_its_schema(client, seed):
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=1.0, seed=seed,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    (choice,) = r.choices
    assert choice.finish_reason == "stop"  # as OpenAI answers a forced call
    assert [name for name, _ in valid_calls(choice.message.tool_calls)] == ["get_time"]


def test_parallel_tool_calls_false_gives_exactly_one_call(client):
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=seed)
        assert len(valid_calls(r.choices[0].message.tool_calls)) == 1


@pytest.mark.parametrize("seed", range(4))
def test_auto_gives_text_that_is_no_call_or_valid_calls(client, seed):
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=1.0, seed=seed,
                                       max_tokens=40)
    message = r.choices[0].message
    if message.tool_calls:
        valid_calls(message.tool_calls)
        assert message.content is None and r.choices[0].finish_reason == "tool_calls"
    else:
        assert not message.content.lstrip().startswith("<tool_call>")


def test_auto_reads_calls_and_text_apart():
    calling = ToolCalling(tuple(t["function"] for t in TOOLS), "auto")
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
    content, calls, finish = calling.read(text, "stop")
    assert content is None and finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "UTC"})]
    assert calling.read("It is sunny.", "stop") == ("It is sunny.", [], "stop")
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'  # the token cap cut the call
    assert calling.read(cut, "length") == (cut, [], "length")


def test_auto_allows_text_or_a_call_and_nothing_else(make_model):
    m = make_model()
    grammar = ToolCalling(tuple(t["function"] for t in TOOLS), "auto").constraint()["grammar"]
    tok = m.tokenizer
    mask = kvql.engine.decode.grammar.Grammar.lark(tok, grammar).mask_fn()
    mask(tok.encode("Answer: sunny"))  # text
    mask(tok.encode('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'))
    with pytest.raises(ValueError, match="grammar error"):
        mask(tok.encode('<tool_call>\n{"name": "no_such_tool"'))


def test_none_offers_no_tools_and_reads_none_back(server):
    with_tools = post(server, {"messages": USER, "tools": TOOLS, "tool_choice": "none"}, "/v1/chat/completions/render")
    without = post(server, {"messages": USER}, "/v1/chat/completions/render")
    assert with_tools.json()["token_ids"] == without.json()["token_ids"]
    r = post(server, {"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 8, "temperature": 0})
    assert "tool_calls" not in r.json()["choices"][0]["message"]


# -- streaming -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tool_choice", ["required", "auto", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_stream_gives_the_same_calls_and_text_as_the_answer(client, tool_choice):
    kw = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=60)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [t for d in deltas for t in d.tool_calls or ()]
    assert [(t.function.name, t.function.arguments) for t in streamed] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or ()]
    assert [t.index for t in streamed] == list(range(len(streamed)))
    assert "".join(d.content or "" for d in deltas) == (whole.message.content or "")
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


# -- the prompt ----------------------------------------------------------------------------------
def rendered_text(server, body) -> str:
    r = post(server, body, "/v1/chat/completions/render")
    assert r.status_code == 200, r.text
    return server[1].tokenizer.decode(r.json()["token_ids"])


def test_the_tools_reach_the_prompt_through_the_template_or_kvqls_description(server):
    text = rendered_text(server, {"messages": USER, "tools": TOOLS})
    assert "get_weather" in text and "The time in a timezone" in text
    # a template that ignores tools gets kvql's description, asking for calls in the Hermes format
    assert ("<tool_call>" in text) == (not server[2])


def test_an_earlier_call_and_its_result_reach_the_template(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"}]
    text = rendered_text(server, {"messages": history, "tools": TOOLS})
    assert "rain, 4 C" in text and "Oslo" in text
    if server[2]:  # the template got the arguments as an object (its tojson writes them once, not as a string)
        assert '<tool_call>get_weather {"city": "Oslo"}</tool_call>' in text
    else:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
        assert "<tool_response>\nrain, 4 C\n</tool_response>" in text


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"tools": TOOLS, "tool_choice": "required", "messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}]}, "messages.1.tool_calls"),
])
def test_a_bad_tool_request_is_a_400_naming_the_field(server, body, param):
    r = post(server, {"messages": USER, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_closing_objects_leaves_a_property_named_like_a_keyword_alone():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                                               "enum": {"enum": [{"properties": {}}]}}}
    held = closed(schema)
    assert held["additionalProperties"] is False and set(held["properties"]) == {"properties", "enum"}
    assert held["properties"]["properties"]["additionalProperties"] is False
    assert held["properties"]["enum"]["enum"] == [{"properties": {}}]  # a value, not a schema
    assert closed({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"] is True


# -- fields clients send -------------------------------------------------------------------------
def test_fields_that_do_not_change_the_answer_are_accepted(server):
    plain = post(server, {"messages": USER, "max_tokens": 6, "temperature": 0}).json()
    extra = {"metadata": {"k": "v"}, "store": False, "service_tier": "auto", "reasoning_effort": "low", "user": "u"}
    r = post(server, {"messages": USER, "max_tokens": 6, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    r = post(server, {"prompt": "Once", "max_tokens": 4, "best_of": 1, "suffix": None, "metadata": {}},
             "/v1/completions")
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param", [({"best_of": 3}, "best_of"), ({"suffix": "end."}, "suffix")])
def test_fields_that_would_change_the_answer_are_a_400_naming_them(server, body, param):
    r = post(server, {"prompt": "Once", "max_tokens": 4, **body}, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    body = {"model": "tiny", "messages": USER, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    *chunks, last = events
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == last["usage"]["completion_tokens"] == 6
    assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in chunks)


# -- real clients on the embedded Instruct model ---------------------------------------------------
@pytest.fixture(scope="module")
def smol_server():
    port = free_port()
    proc = start_server("smollm2-135m", port, budget="64MB")
    yield f"http://127.0.0.1:{port}/v1"
    proc.terminate()
    proc.wait(timeout=60)


@pytest.mark.smollm2
def test_langchain_bind_tools_and_structured_output_on_smollm2(smol_server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    llm = ChatOpenAI(base_url=smol_server, api_key="x", model="smollm2-135m", temperature=0)

    def get_weather(city: str) -> str:
        """The weather of a city."""
        return "sunny"

    out = llm.bind_tools([get_weather], tool_choice="any").invoke("What is the weather in Paris?")
    assert out.tool_calls and all(c["name"] == "get_weather" and isinstance(c["args"]["city"], str)
                                  and set(c["args"]) == {"city"} for c in out.tool_calls)
    streamed = [c for chunk in llm.bind_tools([get_weather], tool_choice="any").stream("What is the weather in Paris?")
                for c in chunk.tool_call_chunks]
    assert [json.loads(c["args"]) for c in streamed] == [c["args"] for c in out.tool_calls]

    class Person(BaseModel):
        name: str
        age: int

    person = llm.with_structured_output(Person, method="function_calling").invoke("Alice is 30 years old.")
    assert isinstance(person, Person)


@pytest.mark.smollm2
def test_a_langchain_chat_without_max_tokens_runs_past_16_tokens_on_smollm2(smol_server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=smol_server, api_key="x", model="smollm2-135m", temperature=0)
    out = llm.invoke("Describe Paris in two sentences.")  # 43 tokens, greedy in float32
    assert out.usage_metadata["output_tokens"] > 16  # it was cut at 16 (issue 26)
    assert out.response_metadata["finish_reason"] == "stop"


@pytest.mark.smollm2
def test_the_openai_client_calls_a_named_tool_on_smollm2(smol_server):
    client = openai.OpenAI(base_url=smol_server, api_key="x", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    r = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


NAMED_BAD = {"type": "function", "function": {"name": "bad"}}
UNSATISFIABLE = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]}


@pytest.mark.parametrize("parameters, tool_choice", [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "required"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, NAMED_BAD),
    ({"type": 5}, "required"), ({"type": 5}, NAMED_BAD),
    (UNSATISFIABLE, NAMED_BAD),  # (under "required" the other tool can still be called: that compiles)
])
def test_a_tool_schema_that_cannot_be_compiled_fails_its_own_request_only(server, parameters, tool_choice):
    bad = {"type": "function", "function": {"name": "bad", "parameters": parameters}}
    for stream in (False, True):  # a stream's bad request is refused before its 200
        r = post(server, {"messages": USER, "tools": [bad, TIME], "tool_choice": tool_choice, "max_tokens": 30,
                          "stream": stream})
        assert r.status_code == 400, r.text
        assert "schema" in r.json()["error"]["message"].lower() or "grammar" in r.json()["error"]["message"].lower()
    good = post(server, {"messages": USER, "tools": TOOLS, "tool_choice": "required", "temperature": 0})
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["tool_calls"]
    server[1].check_integrity()


# -- tool schemas with local references (issue 40) ------------------------------------------------
class City(BaseModel):
    name: Literal["Paris", "Rome", "Oslo"]


class Trip(BaseModel):
    """A trip to a city."""
    city: City
    via: City | None


class Node(BaseModel):
    """A tree of small numbers."""
    n: Literal[1, 2, 3]
    child: Node | None


def function(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# each resolves its references against its own parameters: "#/$defs/City" (as the openai client writes a nested
# Pydantic model), "#/properties/v", a recursive "#", and recursion through "$defs" (a Pydantic tree)
REFERRING = [
    openai.pydantic_function_tool(Trip),
    function("same_as_v", {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                                            "w": {"$ref": "#/properties/v"}}, "required": ["v", "w"]}),
    function("tree", {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}, "child": {"$ref": "#"}},
                      "required": ["n"]}),
    openai.pydantic_function_tool(Node),
]


@pytest.mark.parametrize("tool", REFERRING, ids=lambda t: t["function"]["name"])
def test_a_tool_schemas_references_resolve_against_its_own_parameters(server, tool):
    name, schema = tool["function"]["name"], tool["function"]["parameters"]
    for tool_choice in ("required", "auto", {"type": "function", "function": {"name": name}}):
        for seed in range(2):
            r = post(server, {"messages": USER, "tools": [tool, TIME], "tool_choice": tool_choice, "temperature": 1.0,
                              "seed": seed, "max_tokens": 120})
            assert r.status_code == 200, (tool_choice, r.text)
            for call in r.json()["choices"][0]["message"].get("tool_calls") or ():
                called = call["function"]
                own = schema if called["name"] == name else SCHEMAS[called["name"]]
                jsonschema.validate(json.loads(called["arguments"]), own)  # under the tool's own schema


def test_a_recursive_tool_schema_admits_its_own_calls_and_no_others(make_model):
    tok = make_model().tokenizer
    tree = next(t["function"] for t in REFERRING if t["function"]["name"] == "tree")
    grammar = ToolCalling((tree, TIME["function"]), "required").constraint()["grammar"]

    def admits(arguments: str) -> bool:
        mask = kvql.engine.decode.grammar.Grammar.lark(tok, grammar).mask_fn()
        try:
            mask(tok.encode(f'<tool_call>\n{{"name": "tree", "arguments": {arguments}}}\n</tool_call>'))
        except ValueError:
            return False
        return True

    assert admits('{"n": 1, "child": {"n": 2, "child": {"n": 3}}}')
    assert not admits('{"n": 1, "child": {"name": "tree", "arguments": {"n": 2}}}')  # "#" is not the call


@pytest.mark.parametrize("tool_choice", ["required", "auto", {"type": "function", "function": {"name": "plan_trip"}}])
def test_a_tool_schema_that_does_not_compile_is_a_400_leading_with_the_reason_and_naming_the_tool(server, tool_choice):
    broken = function("plan_trip", {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}})  # no $defs
    r = post(server, {"messages": USER, "tools": [TIME, broken], "tool_choice": tool_choice, "max_tokens": 30})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "Pointer '/$defs/City' does not exist" in message[:100], message  # llguidance's reason, before any grammar
    assert "plan_trip" in message[:200] or isinstance(tool_choice, dict), message  # (a named tool_choice names it)


# -- response_format schemas are held closed too (issue 51) ----------------------------------------
PLACE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "near": {"type": "object", "properties": {"km": {"type": "integer"}}}},
         "required": ["name"]}


def response_format_constraint(schema: dict) -> dict:
    from kvql.server.protocol import ChatRequest
    from kvql.server.request_constraint import constraint_options

    req = ChatRequest.model_validate({"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "Place", "schema": schema}}})
    return constraint_options(req)


def test_a_response_format_schema_is_held_closed_as_a_tools_parameters_are():
    (schema,) = response_format_constraint(PLACE).values()
    assert schema == closed(PLACE)  # one rule for both
    assert schema["additionalProperties"] is False and schema["properties"]["near"]["additionalProperties"] is False
    assert "additionalProperties" not in PLACE  # the request's own schema is left as sent
    kept = response_format_constraint({**PLACE, "additionalProperties": True})["json_schema"]
    assert kept["additionalProperties"] is True  # a schema that says so stays open


def test_a_response_format_constraint_refuses_a_property_the_schema_does_not_declare(make_model):
    tok = make_model().tokenizer
    grammar = kvql.engine.decode.grammar.Grammar.json_schema(tok, response_format_constraint(PLACE)["json_schema"])

    def admits(value: dict) -> bool:
        try:
            grammar.mask_fn()(tok.encode(json.dumps(value)))
        except ValueError:
            return False
        return True

    assert admits({"name": "Paris", "near": {"km": 3}})
    assert not admits({"name": "Paris", "userLocation": "x"})  # SmolLM2 padded a City so until the token cap
    assert not admits({"name": "Paris", "near": {"km": 3, "miles": 2}})


@pytest.mark.smollm2
def test_a_pydantic_response_format_on_smollm2_gives_its_fields_only(smol_server):
    class Town(BaseModel):
        name: str

    schema = Town.model_json_schema()  # as sent by hand: no additionalProperties (the openai client's parse adds it)
    client = openai.OpenAI(base_url=smol_server, api_key="x", max_retries=0)
    for question in ("Tell me about Tokyo.", "Which city should I visit?"):  # open, both padded Town to the cap
        r = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": question}],
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "Town", "schema": schema}},
                                           temperature=0, max_tokens=60)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert set(json.loads(r.choices[0].message.content)) == {"name"}
