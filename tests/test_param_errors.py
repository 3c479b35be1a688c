"""Validation errors carry the field at fault: every ValueError SamplingParams or Config raises for
a bad field is a ParamError whose .param is that field, and the server's 400 reports that param
(read from the exception, never parsed out of its message) with the message unchanged.
"""
import dataclasses
import json
import math
from pathlib import Path

import pytest

from nanovllm.config import VOCABULARIES, Config
from nanovllm.entrypoints.openai.protocol import request_error
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.validation import ParamError
from serving import httpx, server_thread

# Values no field takes all of; each field is tried with each, and must refuse some.
BAD_VALUES = [object(), "bogus", -5, math.nan, 10**30, [object()], {"bogus": object()}]
PROTOCOL = Path(__file__).resolve().parents[1] / "nanovllm" / "entrypoints" / "openai" / "protocol.py"
WAIT_S = 60.0


def refusals(make, names: list[str]) -> dict[str, list[BaseException]]:
    """Field -> the ValueErrors make(field, value) raised over BAD_VALUES."""
    found: dict[str, list[BaseException]] = {name: [] for name in names}
    for name in names:
        for value in BAD_VALUES:
            try:
                make(name, value)
            except ValueError as exc:
                found[name].append(exc)
    return found


def test_every_sampling_params_refusal_is_a_param_error_naming_its_field():
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    for name, errors in refusals(lambda n, v: SamplingParams(**{n: v}), names).items():
        assert errors, f"no bad value refused for {name}"
        for exc in errors:
            assert isinstance(exc, ParamError) and exc.param == name, (name, exc)
    # The checks that need more than one field, or the vocabulary.
    with pytest.raises(ParamError) as seed:
        SamplingParams(seed=2**64 - 1, n=2)
    with pytest.raises(ParamError) as min_tokens:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert (seed.value.param, min_tokens.value.param) == ("seed", "min_tokens")
    for field, params in [("stop_token_ids", SamplingParams(stop_token_ids=[500])),
                          ("logit_bias", SamplingParams(logit_bias={500: 1.0})), ("top_k", SamplingParams(top_k=500))]:
        with pytest.raises(ParamError) as info:
            params.check_vocabulary(100)
        assert info.value.param == field and str(info.value).startswith(field)


def test_every_config_refusal_is_a_param_error_naming_its_field(qwen3_tiny):
    names = [f.name for f in dataclasses.fields(Config) if f.init and f.name != "model"]
    for name, errors in refusals(lambda n, v: Config(qwen3_tiny, **{"device": "cpu", n: v}), names).items():
        assert errors, f"no bad value refused for {name}"
        for exc in errors:  # a dict field may name its key: speculative_config['method']
            assert isinstance(exc, ParamError) and (exc.param == name or exc.param.startswith(f"{name}[")), (name, exc)
    cases = [({"model": "/no/such/dir"}, "model"), ({"tensor_parallel_size": 5}, "tensor_parallel_size"),
             ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "x": 1}}, "speculative_config"),
             ({"speculative_config": {"method": "x"}}, "speculative_config['method']")]
    for kwargs, param in cases:
        with pytest.raises(ParamError) as info:
            Config(**{"model": qwen3_tiny, "device": "cpu", **kwargs})
        assert info.value.param == param, (kwargs, info.value)
    with pytest.raises(ParamError) as info:
        Config.from_kwargs(qwen3_tiny, {"devcie": "cpu"})
    assert info.value.param == "devcie"


def test_config_vocabularies_are_read_from_the_literal_types(qwen3_tiny):
    assert {"device", "kv_cache_dtype", "scheduling_policy", "attention_backend", "preemption_mode"} <= set(VOCABULARIES)
    for name, allowed in VOCABULARIES.items():
        with pytest.raises(ParamError, match=rf"^{name}='nope' is not allowed; {name} must be one of") as info:
            Config(qwen3_tiny, **{name: "nope"})
        assert info.value.param == name and str(allowed) in str(info.value)


def test_request_error_reads_the_param_and_never_the_message():
    fields = {"temperature", "max_tokens", "prompt"}
    # A message that names other fields first: only .param counts.
    error = request_error(ParamError("temperature", "max_tokens=3 and prompt: temperature=-1"), fields)
    assert (error.param, error.message, error.status) == ("temperature", "max_tokens=3 and prompt: temperature=-1",
                                                          400)
    assert request_error(ParamError("priority", "priority=1.5"), fields).param is None  # not a request field
    assert request_error(ParamError("prompt", "prompt token id 9"), fields, "messages").param == "messages"
    assert request_error(ValueError("temperature=-1 ..."), fields, "messages").param == "messages"  # the engine's prompt check
    assert "import re" not in PROTOCOL.read_text() and "re.findall" not in PROTOCOL.read_text()


@pytest.fixture(scope="module")
def server(qwen3_tiny):
    with server_thread(qwen3_tiny) as running:
        yield running


def param_error_of(**kwargs) -> ParamError:
    with pytest.raises(ParamError) as info:
        SamplingParams(**kwargs)
    return info.value


def test_server_400_carries_the_param_error_field_and_message(server):
    chat = [{"role": "user", "content": "hi"}]
    cases = [  # (path, body, param, the message when SamplingParams itself refuses it)
        ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature", param_error_of(temperature=-0.5)),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p", param_error_of(top_p=1.5)),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "min_tokens": 5}, "min_tokens",
         param_error_of(max_tokens=3, min_tokens=5)),
        ("/v1/chat/completions", {"messages": chat, "repetition_penalty": 5.0}, "repetition_penalty",
         param_error_of(repetition_penalty=5.0)),
        ("/v1/completions", {"prompt": "hi", "top_k": 10**6}, "top_k", None),  # past the vocabulary: the engine's check
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix", None),
        ("/v1/chat/completions", {"messages": chat, "top_logprobs": 2}, "top_logprobs", None),
    ]
    for path, body, param, expected in cases:
        response = httpx.post(server.url + path, content=json.dumps(body),
                              headers={"Content-Type": "application/json"}, timeout=WAIT_S)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
        if expected is not None:
            assert error["message"] == str(expected)


@pytest.mark.parametrize("case,param", [
    (dict(prompt=[1, 2, 10**9]), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=list(range(1, 600))), "prompt"),  # longer than max_model_len
    (dict(params=SamplingParams(max_tokens=10_000)), "max_tokens"),  # more KV blocks than the whole cache
    (dict(request_id=""), "request_id"),
    (dict(priority="high"), "priority"),
    (dict(params="greedy"), "sampling_params"),
])
def test_the_engines_request_checks_are_param_errors(qwen3_tiny, case, param):
    """The request builder's own refusals name their field too, so the server's param needs no guess."""
    from nanovllm import LLM
    llm = LLM(qwen3_tiny, device="cpu", max_model_len=512, kvcache_block_size=16, num_kvcache_blocks=20)
    try:
        with pytest.raises(ParamError) as refused:
            llm.add_request(case.get("prompt", [1, 2, 3]), case.get("params", SamplingParams()),
                            request_id=case.get("request_id"), priority=case.get("priority", 0))
        assert refused.value.param == param
        assert not llm._requests  # nothing was queued
    finally:
        llm.exit()


def post_json(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, content=json.dumps(body), headers={"Content-Type": "application/json"},
                      timeout=WAIT_S)


def test_the_server_admits_a_request_once(server, monkeypatch):
    """One admission per request, in the server's prompt thread: the constraint is compiled, the
    prompt tokenized and the vocabulary checks (top_k among them) made once, not again as the
    engine builds the request (this server's engine runs in a thread of its process, so its calls
    are counted too)."""
    from nanovllm.structured_outputs import GrammarCompiler
    calls = {"compile": 0, "encode": 0, "check_vocabulary": 0}

    def counted(cls, name):
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(cls, name, wrapper)
    counted(GrammarCompiler, "compile")
    counted(type(server.app.state.prompt_tokenizer), "encode")  # the engine's tokenizer is of the same class
    counted(SamplingParams, "check_vocabulary")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    requests = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_k": 5,
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "a", "schema": schema}}}),
        ("/v1/completions", {"prompt": "Hello world", "max_tokens": 4, "top_k": 5, "guided_regex": "[a-z]+"}),
        ("/v1/completions", {"prompt": "Hello world", "max_tokens": 4, "stream": True}),
    ]
    for path, body in requests:
        before = dict(calls)
        response = post_json(server, path, body)
        assert response.status_code == 200, response.text
        constrained = "response_format" in body or "guided_regex" in body
        assert {name: calls[name] - before[name] for name in calls} == {
            "compile": int(constrained), "encode": 1, "check_vocabulary": 1}, (path, body)


@pytest.mark.parametrize("path,field,stream", [("/v1/completions", "guided_regex", False),
                                               ("/v1/completions", "structured_outputs", False),
                                               ("/v1/chat/completions", "structured_outputs", True)])
def test_a_grammar_no_output_can_satisfy_is_a_400_naming_its_field(server, path, field, stream):
    """A regex no text matches compiles, but no output can begin: refused as the request is
    admitted (not a 500, or a failed stream, from its first step), naming the field that gave it."""
    def body(regex: str) -> dict:
        prompt = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
        return {**prompt, field: regex if field == "guided_regex" else {"regex": regex}, "max_tokens": 4,
                "stream": stream}
    response = post_json(server, path, body(r"[^\s\S]"))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    named = "guided_regex" if field == "guided_regex" else "structured_outputs.regex"
    assert error["message"].startswith(f"{named} cannot be satisfied"), error["message"]
    assert post_json(server, path, body("[a-z]+")).status_code == 200


def test_an_admitted_prompt_is_built_as_admitted(qwen3_tiny, monkeypatch):
    """The engine builds an admitted prompt without checking or compiling it again, and only with
    the params it was admitted with; one that crossed to another process (pickled) arrives without
    its compiled grammar, which is then compiled where it is built."""
    import pickle
    from nanovllm import LLM
    from nanovllm.structured_outputs import GrammarCompiler
    llm = LLM(qwen3_tiny, device="cpu", kvcache_block_size=16, num_kvcache_blocks=20)
    try:
        params = SamplingParams(max_tokens=3, temperature=0, structured_outputs={"regex": "[a-z]+"})
        admitted = llm._builder.admit([1, 2, 3], params)
        with pytest.raises(ParamError) as refused:
            llm.add_request(admitted, SamplingParams(max_tokens=3, temperature=0))
        assert refused.value.param == "sampling_params" and not llm._requests
        crossed = pickle.loads(pickle.dumps(admitted))
        assert crossed.grammar is None and crossed.token_ids == [1, 2, 3] and crossed.params == params
        compiles = []
        compile_ = GrammarCompiler.compile
        monkeypatch.setattr(GrammarCompiler, "compile", lambda self, p: compiles.append(p) or compile_(self, p))
        monkeypatch.setattr(SamplingParams, "check_vocabulary", lambda self, size: pytest.fail("checked again"))
        as_admitted, as_crossed = llm.generate([admitted, crossed], params, use_tqdm=False)
        assert compiles == [params.structured_outputs]  # the crossed one's only
        assert as_admitted["token_ids"] == as_crossed["token_ids"] and as_admitted["prompt_token_ids"] == [1, 2, 3]
    finally:
        llm.exit()
