"""What real OpenAI and vLLM clients send and expect, on a tiny checkpoint: explicit nulls and
coerced numbers, vLLM's fields implemented or refused by name, chat template controls (kwargs,
continue_final_message, --chat-template), the reasoning parser, /v1/models/{id}, /tokenize,
/detokenize, /version, usage in stream chunks only when asked, and one error shape (a string
`code`) on every error path. Outputs are compared with offline LLM runs, never hard-coded."""
import json
import logging
import random

import openai
import pytest
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.engine.chat import ChatOptions, load_chat_template, render_chat
from nanovllm.entrypoints.openai import request_fields, serving_tokens
from nanovllm.entrypoints.openai.engine_loop import EngineDeadError, QueueFullError
from nanovllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from nanovllm.entrypoints.openai.reasoning import REASONING_PARSERS, Qwen3ReasoningParser
from nanovllm.entrypoints.openai.request_fields import (IMPLEMENTED_ELSEWHERE, REFUSED, VLLM_CHAT_FIELDS,
                                                        VLLM_COMPLETION_FIELDS, screen_fields)
from nanovllm.entrypoints.openai.server_settings import ServerSettings
from serving import ENGINE_KWARGS, httpx, server_thread

API_KEY = "fidelity-key"
MODEL = "tiny"
MAX_TOKENS = 6
# Small enough that a test can send a body past it cheaply.
MAX_REQUEST_BYTES = 64 * 1024
# A Qwen3-like template: the assistant turn opens a <think> block unless enable_thinking is false,
# and a `documents` list is rendered when given.
THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if documents %}{% for d in documents %}{{ 'doc: ' + d['text'] + '\n' }}{% endfor %}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)
CHAT = [{"role": "user", "content": "Count from one to ten:"}]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "think.jinja"
    path.write_text(THINK_TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def offline(qwen3_tiny):
    llm = LLM(qwen3_tiny, **ENGINE_KWARGS)
    yield llm
    llm.exit()


@pytest.fixture(scope="module")
def tokenizer(qwen3_tiny):
    return AutoTokenizer.from_pretrained(qwen3_tiny)


@pytest.fixture(scope="module")
def server(qwen3_tiny, template_file):
    with server_thread(qwen3_tiny, api_key=API_KEY, served_model_name=MODEL, chat_template=template_file,
                       reasoning_parser="qwen3", max_request_bytes=MAX_REQUEST_BYTES) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def post(server, path: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=120,
                      headers={**HEADERS, "Content-Type": "application/json"})


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def sse_events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines()
            if line.startswith("data: {")]


# ---- models, version ----

def test_models_retrieve_and_version(server, client):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    version = httpx.get(server.url + "/version").json()
    assert isinstance(version["version"], str) and version["version"]


# ---- nulls and number coercion ----

def test_explicit_nulls_mean_the_defaults(client, offline):
    expected = offline.generate(["Hello world"], greedy(), use_tqdm=False)[0]
    response = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=MAX_TOKENS, temperature=0,
                                         n=None, stream=None, echo=None, logprobs=None, stop=None, seed=None,
                                         top_p=None, presence_penalty=None, frequency_penalty=None, user=None,
                                         extra_body={"ignore_eos": True, "min_tokens": None,
                                                     "skip_special_tokens": None, "top_k": None})
    assert response.choices[0].text == expected["text"]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                          n=None, stream=None, logprobs=None, top_logprobs=None, stop=None,
                                          extra_body={"add_generation_prompt": None, "ignore_eos": True})
    assert chat.usage.completion_tokens == MAX_TOKENS


@pytest.mark.parametrize("value", [4, 4.0, "4", " 4 "])
def test_integers_coerce_as_openai_does(server, value):
    body = {"prompt": "Hello", "max_tokens": value, "ignore_eos": True, "temperature": "0", "n": 1.0}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("field, value", [("max_tokens", 4.5), ("max_tokens", "4.5"), ("n", True),
                                          ("max_tokens", "four"), ("temperature", "hot"), ("temperature", "nan")])
def test_non_integers_are_refused(server, field, value):
    response = post(server, "/v1/completions", {"prompt": "Hello", field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


def test_top_logprobs_zero_without_logprobs_is_allowed(server):
    response = post(server, "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 0, "max_tokens": 2})
    assert response.status_code == 200, response.text
    refused = post(server, "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2, "max_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"


# ---- vLLM's fields: implemented or refused by name ----

# A value asking for something, per refused field (the test below checks every one is here).
REFUSED_VALUES = {
    "use_beam_search": True, "length_penalty": 0.5, "spaces_between_special_tokens": False,
    "allowed_token_ids": [1, 2], "bad_words": ["fox"], "mm_processor_kwargs": {"size": 1},
    "prompt_embeds": "AAAA", "request_id": "mine", "logits_processors": ["a.b"],
    "return_tokens_as_token_ids": True, "return_token_ids": True, "cache_salt": "salt",
    "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "max_repetition_pattern_size": 2,
    "min_repetition_pattern_size": 2, "repetition_min_count": 2,
}


@pytest.mark.parametrize("fields, model", [(VLLM_COMPLETION_FIELDS, CompletionRequest),
                                           (VLLM_CHAT_FIELDS, ChatCompletionRequest)])
def test_every_vllm_field_is_accounted_for(fields, model):
    unaccounted = fields - set(model.model_fields) - set(REFUSED) - IMPLEMENTED_ELSEWHERE
    assert not unaccounted
    assert set(REFUSED) == set(REFUSED_VALUES)


def _refused_cases():
    cases = []
    for path, fields, model in (("/v1/completions", VLLM_COMPLETION_FIELDS, CompletionRequest),
                                ("/v1/chat/completions", VLLM_CHAT_FIELDS, ChatCompletionRequest)):
        cases += [(path, name) for name in sorted(fields & set(REFUSED) - set(model.model_fields))]
    return cases


@pytest.mark.parametrize("path, field", _refused_cases())
def test_unimplemented_vllm_field_is_a_400_naming_it(server, path, field):
    base = {"prompt": "Hello"} if path == "/v1/completions" else {"messages": CHAT}
    response = post(server, path, {**base, "max_tokens": 2, field: REFUSED_VALUES[field]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"] and error["code"] == "unsupported_parameter"


def test_vllm_defaults_of_refused_fields_are_accepted(server):
    """A full vLLM-shaped request (every refused field at the value that asks for nothing) works."""
    noops = dict(REFUSED)
    for path, base in (("/v1/completions", {"prompt": "Hello", "echo": False}),
                       ("/v1/chat/completions", {"messages": CHAT, "echo": False})):
        response = post(server, path, {**base, **noops, "max_tokens": 2})
        assert response.status_code == 200, (path, response.text)


def test_unknown_fields_are_logged_once_and_ignored(monkeypatch, caplog):
    monkeypatch.setattr(request_fields, "_logged_unknown", set())
    with caplog.at_level(logging.WARNING, logger="nanovllm"):
        for _ in range(3):
            kept = screen_fields({"prompt"}, {"prompt": "hi", "service_tier": "auto"})
            assert kept == {"prompt": "hi"}
    assert sum("service_tier" in r.getMessage() for r in caplog.records) == 1


def test_unknown_field_names_logged_are_bounded(monkeypatch):
    monkeypatch.setattr(request_fields, "_logged_unknown", set())
    for i in range(request_fields.MAX_LOGGED_UNKNOWN_FIELDS * 2):
        screen_fields(set(), {f"field_{i}": 1})
    assert len(request_fields._logged_unknown) == request_fields.MAX_LOGGED_UNKNOWN_FIELDS


def test_truncate_prompt_tokens_keeps_the_prompt_end(server, offline, tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(prompt)
    expected = offline.generate([ids[-3:]], greedy(), use_tqdm=False)[0]
    response = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                 "ignore_eos": True, "truncate_prompt_tokens": 3})
    assert response.json()["choices"][0]["text"] == expected["text"]
    assert response.json()["usage"]["prompt_tokens"] == 3
    for bad in (0, 10**6):
        refused = post(server, "/v1/completions", {"prompt": prompt, "truncate_prompt_tokens": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens"


# ---- tokenize / detokenize ----

def test_tokenize_equals_the_tokenizer(server, tokenizer):
    prompt = "The cache is split into blocks."
    body = post(server, "/tokenize", {"prompt": prompt, "model": MODEL}).json()
    assert body["tokens"] == tokenizer.encode(prompt) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0 and body["token_strs"] is None
    with_strs = post(server, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    assert with_strs["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    chat = post(server, "/tokenize", {"messages": CHAT}).json()
    assert chat["tokens"] == render_chat(tokenizer, CHAT, ChatOptions(chat_template=THINK_TEMPLATE))
    back = post(server, "/detokenize", {"tokens": body["tokens"]}).json()
    assert back["prompt"] == tokenizer.decode(body["tokens"]) == prompt


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, None), ("/tokenize", {"prompt": "a", "messages": CHAT}, None),
    ("/tokenize", {"prompt": "a", "model": "gpt-9"}, "model"), ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": [10**6]}, "tokens"), ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
])
def test_tokenize_refusals(server, path, body, param):
    response = post(server, path, body)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["param"] == param and isinstance(error["code"], str)


# ---- chat template controls ----

def test_chat_template_kwargs_change_the_prompt(server, offline, tokenizer):
    thinking = post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    plain = post(server, "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert tokenizer.decode(thinking).endswith("<think>\n")
    assert tokenizer.decode(plain["tokens"]).endswith("</think>\n\n")
    # The generation route renders the same way: equal to offline LLM.chat with the same options.
    expected = offline.chat(CHAT, greedy(), use_tqdm=False, chat_template=THINK_TEMPLATE,
                            chat_template_kwargs={"enable_thinking": False})[0]
    assert expected["prompt_token_ids"] == plain["tokens"]
    response = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                     "ignore_eos": True,
                                                     "chat_template_kwargs": {"enable_thinking": False}})
    assert response.json()["usage"]["prompt_tokens"] == len(plain["tokens"])
    parts = Qwen3ReasoningParser(tokenizer.decode(plain["tokens"])).split(expected["text"])
    assert response.json()["choices"][0]["message"]["content"] == (parts.content or None)


def test_documents_and_reserved_kwargs(server, tokenizer):
    with_docs = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                      "documents": [{"title": "t", "text": "DOCTEXT"}]})
    assert with_docs.status_code == 200
    rendered = render_chat(tokenizer, CHAT, ChatOptions(chat_template=THINK_TEMPLATE,
                                                        documents=[{"title": "t", "text": "DOCTEXT"}]))
    assert "doc: DOCTEXT" in tokenizer.decode(rendered)
    assert with_docs.json()["usage"]["prompt_tokens"] == len(rendered)
    reserved = post(server, "/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tools": []}})
    assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "chat_template_kwargs"


def test_continue_final_message(server, offline, tokenizer):
    conversation = CHAT + [{"role": "assistant", "content": "one, two,"}]
    body = {"messages": conversation, "continue_final_message": True, "add_generation_prompt": False}
    tokens = post(server, "/tokenize", body).json()["tokens"]
    assert tokenizer.decode(tokens).endswith("one, two,")
    expected = offline.chat(conversation, greedy(), use_tqdm=False, chat_template=THINK_TEMPLATE,
                            add_generation_prompt=False, continue_final_message=True)[0]
    assert expected["prompt_token_ids"] == tokens
    response = post(server, "/v1/chat/completions", {**body, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                     "ignore_eos": True})
    # The prompt does not end in <think>: all of it is content, as the parser splits it.
    parts = Qwen3ReasoningParser(tokenizer.decode(tokens)).split(expected["text"])
    assert response.json()["choices"][0]["message"]["content"] == (parts.content or None)
    both = post(server, "/v1/chat/completions", {"messages": conversation, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "add_generation_prompt"
    not_assistant = post(server, "/v1/chat/completions", {"messages": CHAT, "continue_final_message": True,
                                                          "add_generation_prompt": False})
    assert not_assistant.status_code == 400 and not_assistant.json()["error"]["param"] == "messages"


def test_chat_template_override_and_request_templates(server, tokenizer, template_file):
    override = post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    own = render_chat(tokenizer, CHAT)
    assert override != own
    assert override == render_chat(tokenizer, CHAT, ChatOptions(chat_template=load_chat_template(template_file)))
    refused = post(server, "/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ 'x' }}"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"


def test_request_templates_when_trusted(qwen3_tiny, tokenizer):
    with server_thread(qwen3_tiny, api_key=API_KEY, trust_request_chat_template=True) as trusted:
        template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        tokens = post(trusted, "/tokenize", {"messages": CHAT, "chat_template": template}).json()["tokens"]
        assert tokenizer.decode(tokens) == CHAT[0]["content"]
        broken = post(trusted, "/v1/chat/completions", {"messages": CHAT, "chat_template": "{% for %}"})
        assert broken.status_code == 400 and broken.json()["error"]["param"] == "chat_template"
        # Served under its path (no --served-model-name): a name with slashes is retrieved too.
        client = openai.OpenAI(base_url=trusted.base_url, api_key=API_KEY, max_retries=0, timeout=60)
        assert client.models.retrieve(qwen3_tiny).id == qwen3_tiny


def test_load_chat_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(THINK_TEMPLATE)
    assert load_chat_template(str(path)) == THINK_TEMPLATE
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template("{% for %}")
    for bad in (dict(chat_template=str(tmp_path / "missing.jinja")), dict(reasoning_parser="nope")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerSettings("m", **bad).check()


# ---- reasoning parser ----

SPLITS = [
    ("", "<think>\nabc\n</think>\n\nHello", "\nabc\n", "\n\nHello"),
    ("", "  <think>x</think>y", "x", "y"),
    ("", "Hello <think>not reasoning</think>", "", "Hello <think>not reasoning</think>"),
    ("", "<think>cut short </thi", "cut short </thi", ""),
    ("", "<thi", "", "<thi"),
    ("", "   ", "", "   "),
    ("<|im_start|>assistant\n<think>\n", "reasoning</think>answer", "reasoning", "answer"),
    ("<|im_start|>assistant\n<think>\n", "no end tag", "no end tag", ""),
    ("<|im_start|>assistant\n", "</think>x", "", "</think>x"),
]


@pytest.mark.parametrize("prompt, text, reasoning, content", SPLITS)
def test_reasoning_parser_whole_and_streamed(prompt, text, reasoning, content):
    assert tuple(Qwen3ReasoningParser(prompt).split(text)) == (reasoning, content)
    rng = random.Random(0)
    for _ in range(20):  # the same split for any pieces the text streams in
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        parser = Qwen3ReasoningParser(prompt)
        deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
        assert "".join(d.reasoning for d in deltas) == reasoning
        assert "".join(d.content for d in deltas) == content
        first_content = next((i for i, d in enumerate(deltas) if d.content), len(deltas))
        assert not any(d.reasoning for d in deltas[first_content + 1:])  # reasoning, then content


def test_reasoning_over_http_streamed_and_not(server, offline, tokenizer):
    expected = offline.chat(CHAT, greedy(), use_tqdm=False, chat_template=THINK_TEMPLATE)[0]
    prompt = post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    parts = Qwen3ReasoningParser(tokenizer.decode(prompt)).split(expected["text"])
    assert parts.reasoning  # the prompt opened the reasoning: it holds at least the first tokens
    body = {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    message = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (parts.reasoning, parts.content or None)
    events = sse_events(post(server, "/v1/chat/completions", {**body, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == parts.reasoning
    assert "".join(d.get("content") or "" for d in deltas) == parts.content
    hidden = post(server, "/v1/chat/completions", {**body, "include_reasoning": False}).json()
    assert "reasoning_content" not in hidden["choices"][0]["message"]
    assert set(REASONING_PARSERS) == {"qwen3"}


# ---- stream usage ----

@pytest.mark.parametrize("path, base", [("/v1/completions", {"prompt": "Hello"}),
                                        ("/v1/chat/completions", {"messages": CHAT})])
def test_stream_usage_only_when_asked(server, path, base):
    body = {**base, "max_tokens": 3, "ignore_eos": True, "stream": True}
    plain = sse_events(post(server, path, body))
    assert plain and not any("usage" in e for e in plain)
    counted = sse_events(post(server, path, {**body, "stream_options": {"include_usage": True}}))
    assert all("usage" in e for e in counted)
    assert counted[-1]["usage"]["completion_tokens"] == 3
    assert all(e["usage"] is None for e in counted[:-1])


# ---- one error shape ----

def test_default_codes_are_strings():
    for status in (400, 401, 404, 405, 408, 413, 429, 499, 500, 503):
        error = APIError(status, "x").body()["error"]
        assert isinstance(error["code"], str) and error["code"], status
        assert set(error) == {"message", "type", "param", "code"}


def _check_shape(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["code"], str), error
    return error


def test_error_code_is_a_string_on_every_path(server, monkeypatch):
    _check_shape(post(server, "/v1/completions", {"prompt": 5}), 400)
    _check_shape(post(server, "/v1/completions", "{not json"), 400)
    _check_shape(httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}), 401)
    _check_shape(httpx.get(server.url + "/v1/nowhere", headers=HEADERS), 404)
    _check_shape(post(server, "/v1/completions", {"prompt": "hi", "model": "gpt-9"}), 404)
    _check_shape(httpx.get(server.url + "/v1/completions", headers=HEADERS), 405)
    _check_shape(post(server, "/v1/completions", {"prompt": "x" * MAX_REQUEST_BYTES}), 413)

    def broken(tokenizer, tokens):
        raise RuntimeError("a bug")
    monkeypatch.setattr(serving_tokens, "_detokenize", broken)
    _check_shape(post(server, "/detokenize", {"tokens": [1]}), 500)
    client = server.app.state.engine_client
    for exc, code in ((QueueFullError("full"), "queue_full"), (EngineDeadError("dead"), "engine_not_running")):
        async def refuse(*args, exc=exc):
            raise exc
        with monkeypatch.context() as patch:
            patch.setattr(client, "add", refuse)
            assert _check_shape(post(server, "/v1/completions", {"prompt": "hi"}), 503)["code"] == code


def test_priority_reaches_the_scheduler(server, offline, monkeypatch):
    from nanovllm.engine.llm_engine import LLMEngine
    seen = []
    add_requests = LLMEngine.add_requests

    def recording(self, prompts, params, *args, priority=None, **kwargs):
        seen.append(priority)
        return add_requests(self, prompts, params, *args, priority=priority, **kwargs)
    monkeypatch.setattr(LLMEngine, "add_requests", recording)
    expected = offline.generate(["Hello world"], greedy(), use_tqdm=False)[0]
    response = post(server, "/v1/completions", {"prompt": "Hello world", "max_tokens": MAX_TOKENS, "temperature": 0,
                                                 "ignore_eos": True, "priority": -5})
    assert response.json()["choices"][0]["text"] == expected["text"] and seen == [[-5]]
    refused = post(server, "/v1/chat/completions", {"messages": CHAT, "priority": 2**40})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"


# ---- batch lines take the same chat controls, and refuse what a job does not do ----

def test_batch_lines_carry_chat_options_and_refuse_route_only_fields():
    from nanovllm.entrypoints.batch.lines import BatchRequest, LineError, parse_line
    line = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}, "documents": [{"text": "d"}]}
    request = parse_line(json.dumps(line), 1)
    assert isinstance(request, BatchRequest)
    assert request.chat_options.chat_template_kwargs == {"enable_thinking": False}
    assert request.chat_options.documents == [{"text": "d"}]
    for body, param in (({"prompt": "hi", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
                        ({"messages": CHAT, "priority": 1}, "priority"),
                        ({"messages": CHAT, "include_reasoning": False}, "include_reasoning"),
                        ({"prompt": "hi", "add_special_tokens": False}, "add_special_tokens"),
                        ({"messages": CHAT, "continue_final_message": True}, "add_generation_prompt")):
        error = parse_line(json.dumps(body), 1)
        assert isinstance(error, LineError) and error.param == param, (body, error)


def test_chat_echo_prepends_the_continued_message(server):
    conversation = CHAT + [{"role": "assistant", "content": "one, two,"}]
    body = {"messages": conversation, "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    plain = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "one, two," + plain
    events = sse_events(post(server, "/v1/chat/completions", {**body, "echo": True, "stream": True}))
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == echoed
    # A new assistant turn (add_generation_prompt) after a user message echoes nothing.
    fresh = post(server, "/v1/chat/completions", {"messages": CHAT, "echo": True, "max_tokens": MAX_TOKENS,
                                                  "temperature": 0, "ignore_eos": True}).json()
    assert not (fresh["choices"][0]["message"]["content"] or "").startswith(CHAT[0]["content"])


def test_template_variables_never_make_a_500(server):
    """Every apply_chat_template argument is reserved, and a template failing on a variable's
    value is the request's fault (400), not the server's."""
    import inspect
    from nanovllm.engine.chat import RESERVED_TEMPLATE_ARGS
    from transformers import PreTrainedTokenizerBase
    arguments = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs"}
    assert arguments <= RESERVED_TEMPLATE_ARGS
    for kwargs in ({"self": 1}, {"sanitize_control_tokens": True}, {"enable_thinking": {"a": [1]}},
                   {"enable_thinking": 3}):
        response = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                         "chat_template_kwargs": kwargs})
        assert response.status_code in (200, 400), (kwargs, response.text)
        if response.status_code == 400:
            assert response.json()["error"]["param"] in ("chat_template_kwargs", "messages")


def test_template_run_time_failures_are_blamed_right(tokenizer):
    from nanovllm.engine.chat import BrokenChatTemplateError, ChatTemplateError
    with pytest.raises(ChatTemplateError, match="template variables"):
        render_chat(tokenizer, CHAT, ChatOptions(chat_template="{{ n + 1 }}", chat_template_kwargs={"n": "x"}))
    with pytest.raises(BrokenChatTemplateError, match="TypeError"):
        render_chat(tokenizer, CHAT, ChatOptions(chat_template="{{ messages[0]['content'] + 1 }}"))
