"""The OpenAI-compatible server through the official `openai` client (raw HTTP only for bodies a
client would never send), on a tiny checkpoint, with the engine in a process of its own
(--engine-process; the other serving tests keep it in a thread of the server's process): outputs equal offline LLM.generate / LLM.chat for the same prompts and settings;
a bounded load of concurrent clients, disconnects, a full queue, bad requests and API keys, each
alongside good requests; an engine process that dies fails its requests, not the server."""
import asyncio
import json
import os
import signal
import time

import openai
import pytest

from conftest import build_checkpoint
from helpers import random_prompts
from nanovllm import LLM, SamplingParams
from serving import ENGINE_KWARGS, httpx, metric, server_thread

API_KEY = "test-key"
MODEL = "tiny"
PROMPTS = ["Hello world! How are", "The cache is split into", "Count from one to ten:"]
TOKEN_PROMPT = [101, 7, 254, 33, 480, 12]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8
TEXT_TOKEN_LIMIT = 600  # random prompt ids below this are ordinary text tokens (the special ones come last)
DRAIN_TIMEOUT = 60.0  # seconds for the server to notice disconnects and free everything


@pytest.fixture(scope="module")
def offline(qwen3_tiny):
    llm = LLM(qwen3_tiny, **ENGINE_KWARGS)
    yield llm
    llm.exit()


@pytest.fixture(scope="module")
def server(qwen3_tiny):
    with server_thread(qwen3_tiny, api_key=API_KEY, served_model_name=MODEL, engine_process=True) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ("nanovllm_num_requests_running", "nanovllm_num_requests_waiting", "nanovllm_kv_cache_usage_ratio",
                 "nanovllm_generation_tokens_total", "nanovllm_time_to_first_token_seconds_bucket",
                 "nanovllm_time_per_output_token_seconds_bucket", "nanovllm_num_requests_swapped",
                 "nanovllm_steps_total", "nanovllm_preemptions_total", "nanovllm_blocks_swapped_total"):
        assert name in text


def test_completions_equal_offline(client, offline):
    prompts = [*PROMPTS, TOKEN_PROMPT]
    expected = offline.generate(prompts, greedy(), use_tqdm=False)
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    single = client.completions.create(model=MODEL, prompt=TOKEN_PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    choices = [*response.choices, *single.choices]
    assert [c.index for c in response.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in choices] == [e["text"] for e in expected]
    assert [c.finish_reason for c in choices] == [e["finish_reason"] for e in expected]
    assert response.usage.prompt_tokens == sum(len(e["prompt_token_ids"]) for e in expected[:3])
    assert response.usage.completion_tokens == sum(len(e["token_ids"]) for e in expected[:3])
    assert single.usage.total_tokens == len(TOKEN_PROMPT) + len(expected[3]["token_ids"])
    id_lists = client.completions.create(model=MODEL, prompt=[TOKEN_PROMPT, TOKEN_PROMPT[:3]], max_tokens=MAX_TOKENS,
                                         temperature=0)
    assert [c.text for c in id_lists.choices] == \
        [e["text"] for e in offline.generate([TOKEN_PROMPT, TOKEN_PROMPT[:3]], greedy(), use_tqdm=False)]


def test_sampling_knobs_equal_offline(client, offline):
    """Every sampling field reaches the engine: seeded top-k/top-p/min-p sampling with penalties."""
    knobs = dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=3, presence_penalty=0.5,
                 frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=4)
    expected = offline.generate(PROMPTS, SamplingParams(max_tokens=12, **knobs), use_tqdm=False)
    openai_names = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12,
                                         **{k: v for k, v in knobs.items() if k in openai_names},
                                         extra_body={k: v for k, v in knobs.items() if k not in openai_names})
    assert [c.text for c in response.choices] == [e["text"] for e in expected]
    plain = offline.generate(PROMPTS, SamplingParams(max_tokens=12, seed=3, temperature=0.8), use_tqdm=False)
    assert [e["text"] for e in plain] != [e["text"] for e in expected]  # the knobs changed something


def test_completion_stream_equals_offline(client, offline):
    expected = offline.generate(PROMPTS, greedy(), use_tqdm=False)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    texts, finish, usage = [""] * len(PROMPTS), [None] * len(PROMPTS), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [e["text"] for e in expected]
    assert finish == [e["finish_reason"] for e in expected]
    assert usage.completion_tokens == sum(len(e["token_ids"]) for e in expected)


def test_chat_equals_offline(client, offline):
    expected = offline.chat(CHAT, greedy(), use_tqdm=False)[0]
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected["text"]
    assert response.choices[0].finish_reason == expected["finish_reason"]
    assert response.usage.prompt_tokens == len(expected["prompt_token_ids"])
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["text"]
    assert chunks[-1].choices[0].finish_reason == expected["finish_reason"]


def test_n_and_seed_equal_offline(client, offline):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=MAX_TOKENS)
    expected = offline.generate(PROMPTS[:1], params, use_tqdm=False)[0]["outputs"]
    runs = [client.completions.create(model=MODEL, prompt=PROMPTS[0], n=3, temperature=1.0, seed=11,
                                      max_tokens=MAX_TOKENS) for _ in range(2)]
    for response in runs:
        assert [c.index for c in response.choices] == [0, 1, 2]
        assert [c.text for c in response.choices] == [e["text"] for e in expected]
    assert len({e["text"] for e in expected}) > 1  # the samples differ: seeds per sample work
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, temperature=1.0, seed=5,
                                            max_tokens=MAX_TOKENS, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    chat_expected = offline.chat(CHAT, SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=MAX_TOKENS),
                                 use_tqdm=False)[0]["outputs"]
    assert texts == [e["text"] for e in chat_expected]


def test_stop_equals_offline(client, offline):
    free = offline.generate(PROMPTS[:1], greedy(16), use_tqdm=False)[0]["text"]
    stop = free[6:9]  # a string the greedy answer is known to reach
    expected = offline.generate(PROMPTS[:1], greedy(16, stop=[stop]), use_tqdm=False)[0]
    assert expected["finish_reason"] == "stop"
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
    assert response.choices[0].text == expected["text"]
    assert response.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected["text"]


def test_a_stream_sends_a_chunk_per_token_while_text_is_held_back(client, offline):
    """A stop string of 12 characters that never matches holds back the last 11 characters of
    text: the steps in between still send a chunk each (empty text), as vLLM does, so a client
    timing inter-token latency sees every token; the text joins up to the offline text."""
    stop = "\u2603" * 12  # never produced: every step's text is held back until enough follows
    expected = offline.generate(PROMPTS[:1], greedy(12, stop=[stop]), use_tqdm=False)[0]
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop],
                                       stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert len(chunks) == len(expected["token_ids"]) == 12
    assert "".join(c.text for c in chunks) == expected["text"] and chunks[0].text == ""
    chat = offline.chat(CHAT, greedy(12, stop=[stop]), use_tqdm=False)[0]
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stop=[stop],
                                            stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices][1:]  # after the role's chunk
    assert len(deltas) == len(chat["token_ids"]) == 12
    assert "".join(d.content or "" for d in deltas) == chat["text"] and deltas[0].content == ""


def test_logprobs_equal_offline(client, offline):
    expected = offline.generate(PROMPTS[:1], greedy(logprobs=2), use_tqdm=False)[0]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                         logprobs=2)
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([e["logprob"] for e in expected["logprobs"]])
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs)  # the top 2, and the chosen one
    chat_expected = offline.chat(CHAT, greedy(logprobs=3), use_tqdm=False)[0]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [t.logprob for t in content] == pytest.approx([e["logprob"] for e in chat_expected["logprobs"]])
    assert [[t.logprob for t in c.top_logprobs] for c in content] == \
        [pytest.approx(list(e["top_logprobs"].values())) for e in chat_expected["logprobs"]]


def test_echo(client, offline):
    expected = offline.generate(PROMPTS[:1], greedy(), use_tqdm=False)[0]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                         echo=True)
    assert response.choices[0].text == PROMPTS[0] + expected["text"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert info.value.body["param"] == "model"


def test_api_key_required_on_v1(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            calls = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "hi"}),
                     ("POST", "/v1/chat/completions", {"messages": "not even valid"})]
            for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}):
                for method, path, body in calls:
                    response = await http.request(method, path, json=body, headers=headers)
                    assert response.status_code == 401, (headers, path)
                    assert response.json()["error"]["code"] == "invalid_api_key"
            assert (await http.get("/health")).status_code == 200  # not under /v1
    asyncio.run(run())
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()


# Each body is refused with 400 naming this param (None: the body as a whole).
BAD_COMPLETIONS = [
    ('{"prompt": "hi", "max_tokens": "ten"}', "max_tokens"),
    ('{"prompt": 5}', "prompt"),
    ('{"prompt": []}', "prompt"),
    ('{"prompt": "hi", "temperature": -0.5}', "temperature"),
    ('{"prompt": "hi", "max_tokens": -3}', "max_tokens"),
    ('{"prompt": "hi", "top_p": NaN}', "top_p"),
    ('{"prompt": "hi", "n": 0}', "n"),
    ('{"prompt": "hi", "n": true}', "n"),
    ('{"prompt": "hi", "stop": [1]}', "stop"),
    ('{"prompt": "hi", "logprobs": 50}', "logprobs"),
    ('{"prompt": "hi", "presence_penalty": 3}', "presence_penalty"),
    ('{"prompt": "hi", "seed": 1.5}', "seed"),
    ('{"prompt": [1, 2, 100000]}', "prompt"),
    ('{"prompt": "hi", "max_tokens": 4', None),
    ('[1, 2]', None),
]
BAD_CHATS = [
    ('{"messages": []}', "messages"),
    ('{"messages": "hi"}', "messages"),
    ('{"messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role"),
    ('{"messages": [{"role": "user"}]}', "messages[0].content"),
    ('{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
    ('{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', "top_logprobs"),
]


def test_bad_requests_get_400_naming_the_field(server, offline):
    long_prompt = [7] * (offline.config.max_model_len + 1)
    bad = [("/v1/completions", body, param) for body, param in BAD_COMPLETIONS]
    bad += [("/v1/chat/completions", body, param) for body, param in BAD_CHATS]
    bad.append(("/v1/completions", json.dumps({"prompt": long_prompt}), "prompt"))
    bad.append(("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi " * 2000}]}),
                "messages"))
    prompts = random_prompts(TEXT_TOKEN_LIMIT, [5, 9, 13, 17], seed=3)
    expected = offline.generate(prompts, greedy(16, ignore_eos=True), use_tqdm=False)
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=headers) as http:
            good = [http.post("/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0,
                                                       "ignore_eos": True}) for p in prompts]
            refused = [http.post(path, content=body) for path, body, _ in bad]
            return await asyncio.gather(*good, *refused)

    responses = asyncio.run(run())
    good, refused = responses[:len(prompts)], responses[len(prompts):]
    assert [r.json()["choices"][0]["text"] for r in good] == [e["text"] for e in expected]
    for (path, body, param), response in zip(bad, refused):
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (body, error)
        assert error["type"] == "invalid_request_error" and error["message"]


async def _complete(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int, stream: bool,
                    model: str = MODEL) -> tuple[str, int]:
    """(text, completion tokens) of one greedy completion, streamed or not."""
    kwargs = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        response = await client.completions.create(**kwargs)
        return response.choices[0].text, response.usage.completion_tokens
    chunks = [c async for c in await client.completions.create(**kwargs, stream=True,
                                                               stream_options={"include_usage": True})]
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens


def test_load_200_concurrent_clients(server, offline):
    num = 200
    prompts = random_prompts(TEXT_TOKEN_LIMIT, [3 + i % 13 for i in range(num)], seed=0)
    max_tokens = [1 + i % 6 for i in range(num)]
    expected = offline.generate(prompts, [greedy(m, ignore_eos=True) for m in max_tokens], use_tqdm=False)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=300)
        async with client:
            return await asyncio.gather(*[_complete(client, p, m, stream=i % 2 == 0)
                                          for i, (p, m) in enumerate(zip(prompts, max_tokens))])

    results = asyncio.run(run())
    assert [n for _, n in results] == max_tokens
    assert [text for text, _ in results] == [e["text"] for e in expected]


def _drained(server) -> str:
    """The /metrics text once nothing runs, waits or holds KV blocks (a bounded wait)."""
    end = time.monotonic() + DRAIN_TIMEOUT
    while True:
        text = httpx.get(server.url + "/metrics").text
        if all(metric(text, name) == 0 for name in (
                "nanovllm_num_requests_running", "nanovllm_num_requests_waiting", "nanovllm_kv_cache_usage_ratio")):
            return text
        assert time.monotonic() < end, "the server still holds requests or KV blocks:\n" + text
        time.sleep(0.1)


def test_disconnects_abort_and_free_blocks(server, offline):
    """50 clients leave before their answer is done: 10 that wait for a whole (non-streamed)
    answer, then 40 in mid-stream. Each request is aborted and every KV block is free after."""
    num, num_plain = 50, 10
    prompts = random_prompts(TEXT_TOKEN_LIMIT, [4 + i % 9 for i in range(num)], seed=1)
    aborted_before = metric(_drained(server), "nanovllm_request_finished_total", 'finish_reason="abort"')
    long = {"max_tokens": 1000, "temperature": 0, "extra_body": {"ignore_eos": True}}

    async def leave_mid_stream(client: openai.AsyncOpenAI, prompt: list[int], chat: bool) -> None:
        if chat:
            stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                          stream=True, **long)
        else:
            stream = await client.completions.create(model=MODEL, prompt=prompt, stream=True, **long)
        async for _ in stream:  # the first chunk came: the engine has the request
            break
        await stream.close()

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=300)
        async with client, httpx.AsyncClient(base_url=server.url) as http:
            waiting = [asyncio.ensure_future(client.completions.create(model=MODEL, prompt=p, **long))
                       for p in prompts[:num_plain]]
            end = time.monotonic() + DRAIN_TIMEOUT
            while metric((await http.get("/metrics")).text, "nanovllm_num_requests_running") < num_plain:
                assert time.monotonic() < end, "the non-streaming requests never ran"
                await asyncio.sleep(0.05)
            for task in waiting:  # their clients give up: the connections close
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            await asyncio.gather(*[leave_mid_stream(client, p, chat=i % 5 == 0)
                                   for i, p in enumerate(prompts[num_plain:])])
            # The server is still good for requests that stay.
            return await _complete(client, prompts[0], MAX_TOKENS, stream=True)

    text, _ = asyncio.run(run())
    assert text == offline.generate(prompts[:1], greedy(ignore_eos=True), use_tqdm=False)[0]["text"]
    after = _drained(server)
    assert metric(after, "nanovllm_request_finished_total", 'finish_reason="abort"') - aborted_before == num


def test_full_queue_gets_503_and_nothing_else_fails(qwen3_tiny, offline):
    """Two long requests fill the two batch slots; of the requests that follow, max_queue_len are
    queued (and complete once a slot frees), the rest get 503 with Retry-After."""
    queue_len, num = 3, 12
    prompts = random_prompts(TEXT_TOKEN_LIMIT, [6] * num, seed=2)
    expected = offline.generate(prompts, greedy(4, ignore_eos=True), use_tqdm=False)
    with server_thread(qwen3_tiny, max_queue_len=queue_len, engine_overrides={"max_num_seqs": 2}) as server:
        async def run():
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
            async with client:
                long = [await client.completions.create(model=server.settings.model_name, prompt=prompts[0],
                                                        max_tokens=1000, temperature=0, stream=True,
                                                        extra_body={"ignore_eos": True}) for _ in range(2)]
                for stream in long:  # both are running
                    await anext(aiter(stream))
                short = [asyncio.ensure_future(_complete(client, p, 4, i % 2 == 1, server.settings.model_name))
                         for i, p in enumerate(prompts)]
                # The refusals come at once; the queued requests wait for a slot.
                while sum(task.done() for task in short) < num - queue_len:
                    await asyncio.wait([t for t in short if not t.done()], return_when=asyncio.FIRST_COMPLETED)
                for stream in long:  # free the slots: the queued requests run now
                    await stream.close()
                return await asyncio.gather(*short, return_exceptions=True)

        results = asyncio.run(run())
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(refused) == num - queue_len
    for error in refused:
        assert isinstance(error, openai.InternalServerError) and error.status_code == 503
        assert error.response.headers["retry-after"].isdigit()
        assert error.body["code"] == "queue_full"
    served = [(i, r) for i, r in enumerate(results) if not isinstance(r, Exception)]
    assert [text for _, (text, _) in served] == [expected[i]["text"] for i, _ in served]
    assert all(n == 4 for _, (_, n) in served)


def test_shutdown_aborts_what_outlasts_the_grace_period(tmp_path):
    """A stream that cannot finish within the grace period ends with an "abort" chunk (and [DONE],
    which the client reads as the end), and the engine stops (SIGTERM's path in a subprocess is
    tested in test_cli.py; the non-streaming side in test_server_faults.py)."""
    # The abort comes SHUTDOWN_ABORT_MARGIN_S (1 s, at most half the grace period) before the grace
    # period ends, and the abort chunk must be written in that margin. A 0.25 s margin, then a 0.5 s
    # one, were each missed once on a loaded 2-core CI host (uvicorn closed the connection first):
    # so a 2 s grace period (1 s margin) and a stream long enough to outlast it (3,000 tokens take
    # the tiny model ~2 s here), on a checkpoint with room for them.
    path = build_checkpoint(str(tmp_path), "qwen3", max_position_embeddings=4096)
    with server_thread(path, shutdown_timeout=2.0) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
        stream = client.completions.create(model=server.settings.model_name, prompt=PROMPTS[0], max_tokens=3000,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = [next(stream)]  # it is generating
        server.uvicorn.should_exit = True
        chunks += list(stream)
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
        assert chunks[-1].choices[0].finish_reason == "abort"
    assert not server.app.state.engine_client.is_running


def test_a_dead_engine_process_fails_its_requests_and_the_server_says_so(qwen3_tiny):
    """The engine runs in a process of its own. Killed mid-stream (as an out-of-memory killer
    would), the stream ends with an error event and [DONE], /health turns 503, a new request gets
    a 503 naming the state, and the server still stops cleanly."""
    with server_thread(qwen3_tiny, engine_process=True) as server:
        engine = server.app.state.engine_client
        assert engine.engine_pid not in (None, os.getpid())
        body = {"model": qwen3_tiny, "prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.Client(base_url=server.base_url, timeout=DRAIN_TIMEOUT) as http:
            assert http.get(server.url + "/health").status_code == 200
            with http.stream("POST", "/completions", json=body) as response:
                lines = (line for line in response.iter_lines() if line)
                assert json.loads(next(lines)[len("data: "):])["choices"][0]["finish_reason"] is None
                os.kill(engine.engine_pid, signal.SIGKILL)
                rest = list(lines)
            assert rest[-1] == "data: [DONE]"
            assert "engine process exited" in json.loads(rest[-2][len("data: "):])["error"]["message"]
            assert http.get(server.url + "/health").status_code == 503
            refused = http.post("/completions", json={**body, "stream": False})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_not_running"
    assert not engine.is_running


def test_constraints_with_the_engine_in_its_own_process(client):
    """Beside an engine process the server compiles each constraint with a compiler of its own (one
    that does not compile is a 400 naming its field before the engine sees it), and the engine
    applies the constraint it compiles for itself."""
    for seed in range(3):
        text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=seed,
                                         extra_body={"guided_choice": ["red", "green"]}).choices[0].text
        assert text in ("red", "green")
    bogus = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, response_format=bogus)
    assert "response_format" in str(refused.value)
