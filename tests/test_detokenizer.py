"""Incremental detokenization with the prompt as context, for byte-level BPE, SentencePiece (with
its leading-space marker and byte fallback) and WordPiece tokenizers (tests/tokenizer_families.py):
for random prompts and random outputs, the prompt's text plus every streamed delta is the text
of prompt and output decoded together; the non-streamed text is the same as the deltas joined;
no delta ends in a character still incomplete (U+FFFD) before the end, and a token whose text is
complete gives exactly one delta. End to end, an engine whose checkpoint has the SentencePiece
tokenizer streams and returns its first token's leading space."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from helpers import greedy
from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import REPLACEMENT_CHAR, Detokenizer, decode_after
from serving import httpx, server_thread
from tokenizer_families import FAMILIES, NON_ASCII, build_family_tokenizer, with_tokenizer

# Prompt text: ASCII words and punctuation, the corpus' non-ASCII characters, and characters no
# tokenizer here has a token for (spelled in bytes, so split across tokens).
ALPHABET = "abcdefghij klmnopqrstuvwxyz ABC .,!?'-\n0123" + NON_ASCII + "Ωж中🎉ß"
EXAMPLES = 60  # per family: each runs a few dozen small decodes


@pytest.fixture(scope="module", params=FAMILIES)
def tokenizer(request, tmp_path_factory):
    path = build_family_tokenizer(request.param, str(tmp_path_factory.mktemp(request.param)))
    return AutoTokenizer.from_pretrained(path)


def stream(tokenizer, prompt: list[int], output: list[int], params: SamplingParams) -> tuple[list[str], str]:
    """One delta per token as the engine hands them out (the last one at the finish), and the
    detokenizer's final text."""
    detokenizer = Detokenizer(tokenizer, params, prompt)
    deltas = []
    for i, token_id in enumerate(output):
        detokenizer.add_token(token_id, check_stop=False)
        deltas.append(detokenizer.stream_delta(finished=i == len(output) - 1))
    return deltas, detokenizer.final_text()


def outputs(tokenizer) -> st.SearchStrategy[list[int]]:
    """Random outputs of up to 12 pieces: any token, except that with byte fallback (SentencePiece)
    byte tokens come as whole characters' spellings. (tokenizers' ByteFallback turns a whole run of
    byte tokens that is not valid UTF-8 into U+FFFD each, the prompt's bytes in the run included,
    rewriting text already sent; so only valid UTF-8 is drawn. A character cut off by the end of a
    stream is test_multi_byte_character_split_across_tokens_is_held_back's.)"""
    vocab = tokenizer.get_vocab()
    byte_ids = {vocab[f"<0x{b:02X}>"] for b in range(256)} if "<0x00>" in vocab else set()
    tokens = st.integers(0, len(tokenizer) - 1).filter(lambda t: t not in byte_ids).map(lambda t: [t])
    if byte_ids:
        spelled = st.characters().map(lambda c: [vocab[f"<0x{b:02X}>"] for b in c.encode()])
        tokens = st.one_of(tokens, spelled)
    return st.lists(tokens, min_size=1, max_size=12).map(lambda pieces: [t for p in pieces for t in p])


_complete: dict[str, list[int]] = {}


def complete_tokens(tokenizer) -> list[int]:
    """The tokens whose text alone is non-empty, not all space, with no incomplete character."""
    if tokenizer.name_or_path not in _complete:
        texts = [tokenizer.decode([t], skip_special_tokens=True) for t in range(len(tokenizer))]
        _complete[tokenizer.name_or_path] = [t for t, text in enumerate(texts)
                                             if text.strip() and REPLACEMENT_CHAR not in text]
    return _complete[tokenizer.name_or_path]


def settings_for_fixture(examples: int):
    return settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings_for_fixture(EXAMPLES)
@given(data=st.data())
def test_prompt_text_and_deltas_are_the_whole_decode(tokenizer, data):
    prompt_text = data.draw(st.text(ALPHABET, min_size=1, max_size=40), label="prompt")
    prompt = tokenizer.encode(prompt_text)
    if not prompt:
        return  # nothing to prompt with (e.g. WordPiece drops whitespace-only text)
    output = data.draw(outputs(tokenizer), label="output")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    params = SamplingParams(skip_special_tokens=skip)
    deltas, final = stream(tokenizer, prompt, output, params)
    whole = tokenizer.decode(prompt + output, skip_special_tokens=skip)
    assert tokenizer.decode(prompt, skip_special_tokens=skip) + "".join(deltas) == whole
    assert final == "".join(deltas) == decode_after(tokenizer, prompt, output, skip)  # streamed or not
    assert not any(delta.endswith(REPLACEMENT_CHAR) for delta in deltas[:-1])


@settings_for_fixture(EXAMPLES)
@given(data=st.data())
def test_one_delta_per_complete_token(tokenizer, data):
    """Tokens whose text is a whole, non-empty piece of text each give exactly one delta."""
    complete = complete_tokens(tokenizer)
    prompt = tokenizer.encode(data.draw(st.text(ALPHABET, min_size=1, max_size=20), label="prompt")) or complete[:1]
    output = data.draw(st.lists(st.sampled_from(complete), min_size=1, max_size=12), label="output")
    deltas, _ = stream(tokenizer, prompt, output, SamplingParams())
    assert all(deltas), deltas


def test_multi_byte_character_split_across_tokens_is_held_back(tokenizer):
    """A character spelled in several tokens is emitted once whole, with the token completing it."""
    prompt = tokenizer.encode("abc")
    for char in "中🎉€":
        ids = tokenizer.encode("abc" + char)[len(prompt):]
        if len(ids) < 2:  # a token of its own here (or WordPiece's [UNK]): nothing to hold back
            continue
        deltas, final = stream(tokenizer, prompt, ids, SamplingParams())
        assert deltas[:-1] == [""] * (len(ids) - 1) and final.endswith(char) and REPLACEMENT_CHAR not in final


def test_context_does_not_begin_inside_a_character_spelled_in_bytes(tokenizer):
    """A prompt ending in characters spelled in byte tokens (byte fallback): a context of its last
    five tokens would begin with continuation bytes, and the byte-fallback decoder would turn the
    whole byte run, the output's byte tokens included, into U+FFFD (hypothesis found ['', '\ufffd!']
    for this prompt and <0x00>, '!'). The context reaches back to the character's first byte."""
    vocab = tokenizer.get_vocab()
    if "<0x00>" not in vocab or "!" not in vocab:
        pytest.skip("no byte fallback in this tokenizer family")
    prompt = tokenizer.encode("🎉🎉")
    output = [vocab["<0x00>"], vocab["!"]]
    deltas, final = stream(tokenizer, prompt, output, SamplingParams())
    assert deltas == ["\x00", "!"] and final == "\x00!"
    assert tokenizer.decode(prompt) + final == tokenizer.decode(prompt + output)


@pytest.fixture(scope="module")
def sentencepiece_checkpoint(qwen3_tiny, tmp_path_factory) -> str:
    return with_tokenizer(qwen3_tiny, "sentencepiece", str(tmp_path_factory.mktemp("qwen3_sp")))


def test_engine_keeps_the_first_tokens_leading_space(sentencepiece_checkpoint):
    """With SentencePiece, decoding the completion alone drops its first space; the engine's text,
    streamed or not, is what the prompt and completion decode to together, after the prompt."""
    tokenizer = AutoTokenizer.from_pretrained(sentencepiece_checkpoint)
    spaced = [t for t in range(len(tokenizer)) if tokenizer.convert_ids_to_tokens(t).startswith("\u2581")
              and len(tokenizer.convert_ids_to_tokens(t)) > 1]
    prompt = tokenizer.encode("the cache is")
    # A logit bias makes the first generated token one that starts with the space marker.
    params = greedy(6, logit_bias={spaced[0]: 100.0})
    with LLM(sentencepiece_checkpoint, device="cpu", kvcache_block_size=16) as llm:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        deltas = [s.text for s in llm.stream([prompt], params)]
    whole = tokenizer.decode(prompt + out["token_ids"])
    assert out["text"].startswith(" ") and tokenizer.decode(prompt) + out["text"] == whole
    assert "".join(deltas) == out["text"] and len([d for d in deltas if d]) == len(out["token_ids"])


def test_server_keeps_the_first_tokens_leading_space(sentencepiece_checkpoint):
    """The same over HTTP: /v1/completions' text, streamed or not, is the completion as decoded
    after the prompt (" t..." where decoding it alone gives "t...")."""
    tokenizer = AutoTokenizer.from_pretrained(sentencepiece_checkpoint)
    spaced = next(t for t in range(len(tokenizer)) if tokenizer.convert_ids_to_tokens(t).startswith("\u2581")
                  and len(tokenizer.convert_ids_to_tokens(t)) > 1)
    body = {"prompt": "the cache is", "max_tokens": 6, "temperature": 0, "logit_bias": {str(spaced): 100},
            "ignore_eos": True}
    with server_thread(sentencepiece_checkpoint) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        text = http.post("/completions", json=body).json()["choices"][0]["text"]
        deltas = []
        with http.stream("POST", "/completions", json={**body, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    deltas += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert text.startswith(" ") and text == "".join(deltas)
    assert len([d for d in deltas if d]) == body["max_tokens"]  # one delta per token
