"""Tool calling and structured outputs over HTTP, through the official openai client: a named
tool_choice and "required" yield tool_calls whose arguments validate against the function's
schema (whole and streamed); "auto" finds Hermes calls in the text; a conversation with a tool
call and a tool message round-trips; response_format, structured_outputs and the guided_*
aliases constrain the answer; a constraint that does not compile is a 400 naming the field.
The Hermes parser is checked on fixed texts, whole and in pieces.

The checkpoint's chat template renders tools and tool messages as Qwen's (Hermes) does.
"""
import json
import os
import random

import jsonschema
import openai
import pytest

from nanovllm.engine.chat import ChatOptions, render_chat
from nanovllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedToolCall
from serving import httpx, server_thread

# Qwen2.5's tool format in a few lines: the tools as JSON in a system turn, an assistant's calls in
# <tool_call> tags, a tool's answer in <tool_response> tags in a user turn.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls %}\n<tool_call>\n{{ {'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson }}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Enough for a random model under the whitespace bound (structured_outputs/compiler.py) to finish.
MAX_TOKENS = 320


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory) -> str:
    from nanovllm.testing.synthetic import build_checkpoint
    path = build_checkpoint(str(tmp_path_factory.mktemp("qwen3_tools")), "qwen3")
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(TOOLS_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(tools_model):
    with server_thread(tools_model, tool_call_parser="hermes") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def assert_valid_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({call.id for call in calls}) == len(calls)


def streamed(client, **kwargs):
    """A streamed chat answer reassembled as the openai client's users do: content, and tool calls by index."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = piece.id or call["id"]
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# ---- the Hermes parser on fixed texts ----

ONE_CALL = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
TWO_CALLS = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}</tool_call>\n'
             '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n')
MALFORMED = 'Let me see <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> done'


@pytest.mark.parametrize("text, content, calls", [
    (ONE_CALL, "Sure.", [ParsedToolCall("get_weather", '{"city": "Paris", "days": 2}')]),
    (TWO_CALLS, None, [ParsedToolCall("get_weather", '{"city": "Oslo", "days": 1}'),
                       ParsedToolCall("get_time", '{"zone": "UTC"}')]),
    (MALFORMED, MALFORMED, []),
    ("No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}', None,
     [ParsedToolCall("get_time", '{"zone": "CET"}')]),  # unclosed at the end of the output
])
def test_hermes_parser_whole_and_streamed_in_pieces(text, content, calls):
    parser = TOOL_PARSERS["hermes"]()
    assert parser.extract(text) == (content, calls)
    rng = random.Random(0)
    for _ in range(20):  # random cuts, down to one character per piece
        stream, pieces, i = parser.stream(), [], 0
        while i < len(text):
            n = rng.randint(1, 8)
            pieces += stream.feed(text[i:i + n])
            i += n
        pieces += stream.finish()
        assert "".join(p for p in pieces if isinstance(p, str)) == (content or "")
        assert [p for p in pieces if isinstance(p, ParsedToolCall)] == calls


# ---- tools through the server ----

def test_a_named_tool_choice_calls_that_function_with_valid_arguments(client):
    kwargs = dict(model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert_valid_calls(choice.message.tool_calls, {"get_weather"})
    assert len(choice.message.tool_calls) == 1
    content, calls, finish = streamed(client, **kwargs)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]  # greedy: the same call


# With parallel calls a random model adds calls for as long as it samples "," over "]": one to ten,
# ~57 tokens each (40 seeds on CPU: 15 went past MAX_TOKENS), and a seed's sample differs by device
# (seed 4 ended at max_tokens on an H200). So the parallel case takes the first of these seeds whose
# answer finishes; the chance that none does is about 1e-5.
PARALLEL_SEEDS = range(4, 16)


def test_required_parallel_makes_calls_to_offered_functions_with_valid_arguments(client):
    kwargs = dict(model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  max_tokens=MAX_TOKENS, temperature=1.0, parallel_tool_calls=True)
    for seed in PARALLEL_SEEDS:
        response = client.chat.completions.create(**kwargs, seed=seed)
        choice = response.choices[0]
        if choice.finish_reason == "tool_calls":
            break
        assert choice.finish_reason == "length" and response.usage.completion_tokens == MAX_TOKENS, choice
    else:
        pytest.fail(f"no seed of {list(PARALLEL_SEEDS)} finished its calls within {MAX_TOKENS} tokens")
    assert_valid_calls(choice.message.tool_calls, set(SCHEMAS))


def test_required_makes_one_call_to_an_offered_function_with_valid_arguments(client):
    kwargs = dict(model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  max_tokens=MAX_TOKENS, temperature=1.0, seed=4, parallel_tool_calls=False)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message.tool_calls, set(SCHEMAS))
    assert len(choice.message.tool_calls) == 1
    content, calls, finish = streamed(client, **kwargs)
    assert finish == "tool_calls" and calls
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]  # the same seed: the same calls


def test_auto_finds_hermes_calls_in_the_answer(client):
    """The answer is forced (structured_outputs choice) to a Hermes call the parser must find."""
    kwargs = dict(model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                  max_tokens=MAX_TOKENS, extra_body={"structured_outputs": {"choice": [ONE_CALL]}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2})]
    content, calls, finish = streamed(client, **kwargs)
    assert (content, finish) == ("Sure.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris", "days": 2})]
    assert calls[0]["id"].startswith("call_")


def test_a_tool_round_trip_renders_the_call_and_the_answer(client, tools_model):
    """The assistant's call (content null) and the tool's answer go back in; the prompt the server
    counted is the template's rendering of exactly that conversation, tools included."""
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    assistant = {**first.choices[0].message.model_dump(exclude_none=True), "content": None}  # as OpenAI sends it
    history = MESSAGES + [assistant, {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    second = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=4)
    assert second.choices[0].message.tool_calls in (None, [])
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tools_model)
    template_history = MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    expected = render_chat(tokenizer, template_history, ChatOptions())  # tool_choice "none": no tools rendered
    assert second.usage.prompt_tokens == len(expected)
    rendered = tokenizer.decode(expected)
    assert "<tool_response>" in rendered and json.dumps(json.loads(call.function.arguments)) in rendered


@pytest.mark.parametrize("body, status, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400, "tools[0].function.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     400, "response_format"),
    ({"guided_regex": "(unclosed"}, 400, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, 400, "tools"),
    ({"structured_outputs": {"grammar": "root ::= \"x"}}, 400, "structured_outputs"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, 400, None),
])
def test_bad_tool_and_constraint_requests_are_400_naming_the_field(server, body, status, param):
    response = httpx.post(server.base_url + "/chat/completions", timeout=60,
                          json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    assert error["message"]


def test_auto_without_a_parser_is_refused(tools_model):
    with server_thread(tools_model) as running:
        response = httpx.post(running.base_url + "/chat/completions", timeout=60,
                              json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4})
    assert response.status_code == 400 and "--tool-call-parser" in response.json()["error"]["message"]


# ---- structured outputs through the server ----

def test_response_format_json_schema_and_json_object(client, tools_model):
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), WEATHER)
    from transformers import AutoTokenizer
    close = AutoTokenizer.from_pretrained(tools_model).convert_tokens_to_ids("}")
    # Any object: the grammar allows "}" right after "{", and the bias (applied after the mask) takes it.
    answer = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                            response_format={"type": "json_object"}, logit_bias={str(close): 100})
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["red", "green"]}, lambda text: text in ("red", "green")),
    ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda text: len(text) == 6 and text[3] == "-"),
    ({"structured_outputs": {"json": WEATHER, "disable_any_whitespace": True}},
     lambda text: jsonschema.validate(json.loads(text), WEATHER) is None),
    ({"guided_json": WEATHER}, lambda text: jsonschema.validate(json.loads(text), WEATHER) is None),
])
def test_structured_outputs_and_guided_aliases_on_both_endpoints(client, extra, check):
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, extra_body=extra,
                                          temperature=1.0, seed=1, n=2 if "guided_choice" in extra else 1)
    completion = client.completions.create(model=model, prompt="Answer:", max_tokens=MAX_TOKENS, extra_body=extra,
                                           temperature=0)
    texts = [c.message.content for c in chat.choices] + [completion.choices[0].text]
    assert all(c.finish_reason == "stop" for c in [*chat.choices, *completion.choices])
    for text in texts:
        assert check(text) is not False, text


def test_llm_chat_takes_tools_and_a_tool_call_history(tools_model):
    """Offline: LLM.chat renders tools and a history with a call (content None) and its answer,
    and a structured_outputs constraint holds there too; content None elsewhere is refused."""
    from nanovllm import LLM, SamplingParams
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    params = SamplingParams(max_tokens=8, temperature=0, structured_outputs={"choice": ["noon", "midnight"]})
    with LLM(tools_model, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        out = llm.chat(history, params, use_tqdm=False, tools=TOOLS)
        assert out[0]["text"] in ("noon", "midnight")
        with pytest.raises(ValueError, match="content None only in an assistant message with tool_calls"):
            llm.chat([{"role": "user", "content": None}], params, use_tqdm=False)


# ---- LangChain's ChatOpenAI against the server ----

@pytest.fixture(scope="module")
def chat_model(server, client):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(model=client.models.list().data[0].id, base_url=server.base_url, api_key="unused",
                      max_tokens=MAX_TOKENS, temperature=0, max_retries=0, timeout=120)


def test_langchain_with_structured_output_gets_a_valid_object(chat_model):
    """with_structured_output (json_schema, its default) on a pydantic model and on a JSON schema:
    LangChain parses and validates the answer itself."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: Literal["Paris", "Oslo", "Lima"]
        days: int = Field(ge=1, le=7)

    answer = chat_model.with_structured_output(Weather).invoke("What is the weather in Paris?")
    assert isinstance(answer, Weather)
    schema = {"title": "weather", "description": "a forecast request", **WEATHER}
    answer = chat_model.with_structured_output(schema, method="json_schema").invoke("And in Oslo?")
    jsonschema.validate(answer, WEATHER)


@pytest.mark.parametrize("tool_choice", ["get_weather", "any"])
def test_langchain_bind_tools_yields_tool_calls_and_round_trips(chat_model, tool_choice):
    """bind_tools with a named function and with "any" (OpenAI's "required"): the AIMessage's
    tool_calls carry ids and arguments valid for the schema; that message and a ToolMessage go
    back in and the answer is plain text. (One call at a time: a random model making many may
    run out of tokens before the list closes.)"""
    from langchain_core.messages import HumanMessage, ToolMessage
    bound = chat_model.bind_tools(TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    question = HumanMessage("What is the weather in Paris?")
    reply = bound.invoke([question])
    assert reply.tool_calls and all(call["id"].startswith("call_") for call in reply.tool_calls)
    for call in reply.tool_calls:
        assert tool_choice == "any" or call["name"] == tool_choice
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    answers = [ToolMessage(json.dumps({"forecast": "sunny"}), tool_call_id=call["id"]) for call in reply.tool_calls]
    final = chat_model.bind_tools(TOOLS, tool_choice="none").invoke([question, reply, *answers])
    assert isinstance(final.content, str) and not final.tool_calls
