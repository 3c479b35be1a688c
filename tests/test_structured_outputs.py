"""Structured outputs (StructuredOutputsParams through xgrammar): every constraint, in every
sampling mode, yields tokens that xgrammar's own matcher (compiled here, apart from the engine's)
accepts one by one, and outputs that finish parse and validate; bad constraints are refused
before any work; speculative decoding rejects proposals the grammar forbids.

A random-weight model under a grammar must still obey it: that is what is tested, not quality.
The checkpoint's byte-level BPE tokenizer can spell any JSON.
"""
import json
import re

import jsonschema
import pytest
import torch
import xgrammar

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm import sampling_params as sampling_params_module
from nanovllm.scheduling.sequence import Sequence
from nanovllm.layers.rejection_sampler import RejectionSampler
from nanovllm.layers.sampler import inverse_transform_draw
from nanovllm.runner.sampling_inputs import prepare_sampling
from nanovllm.structured_outputs import GrammarCompiler

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"},
                                           "tag": {"type": "string", "enum": ["red", "green", "blue"]}},
          "required": ["id", "ok", "tag"]}
CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[a-c]{2,6}-[0-9]{1,3}"
# Each constraint as the engine gets it, and how the test checks a finished output.
CONSTRAINTS = {
    "choice": dict(choice=CHOICES),
    "regex": dict(regex=REGEX),
    "json": dict(json=SCHEMA, disable_any_whitespace=True),
    "json_object": dict(json_object=True, disable_any_whitespace=True),
}
# A prompt whose text repeats what the constraints produce, so the n-gram proposer has matches.
PROMPT = ('{"id": 7, "ok": true, "tag": "red"} {"id": 7, "ok": false, "tag": "blue"} yes no maybe so '
          'abc-12 abc-12 {} {"id": 7, "ok": true, "tag": "red"}')
MODES = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=1.0, seed=7),
    "top_k_top_p_penalties": dict(temperature=0.8, seed=3, top_k=40, top_p=0.9, repetition_penalty=1.3),
    "n3": dict(temperature=1.0, seed=11, n=3),
}
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def llm(qwen3_tiny):
    with LLM(qwen3_tiny, kvcache_block_size=16, num_kvcache_blocks=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def spec_llm(qwen3_tiny):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(qwen3_tiny, kvcache_block_size=16, num_kvcache_blocks=256, speculative_config=spec) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(qwen3_tiny):
    """xgrammar compiled here, apart from the engine: the oracle each output is replayed through."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tiny)
    vocab_size = json.load(open(f"{qwen3_tiny}/config.json"))["vocab_size"]
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                   stop_token_ids=[tokenizer.eos_token_id])
    return xgrammar.GrammarCompiler(info)


def reference_grammar(compiler: xgrammar.GrammarCompiler, kind: str) -> xgrammar.CompiledGrammar:
    if kind == "choice":  # as a regex: a different path from the engine's EBNF alternatives
        return compiler.compile_regex("|".join(re.escape(c).replace("\\ ", " ") for c in CHOICES))
    if kind == "regex":
        return compiler.compile_regex(REGEX)
    if kind == "json":
        return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=False)


def check_sample(compiler: xgrammar.GrammarCompiler, kind: str, sample: dict) -> None:
    """Every token accepted in order; a finished ("stop") output complete, parsed and valid."""
    matcher = xgrammar.GrammarMatcher(reference_grammar(compiler, kind))
    for i, token_id in enumerate(sample["token_ids"]):
        assert matcher.accept_token(token_id), f"{kind}: token {i} ({token_id}) of {sample['token_ids']} refused"
    if sample["finish_reason"] != "stop":
        assert sample["finish_reason"] == "length" and len(sample["token_ids"]) == MAX_TOKENS
        return
    assert matcher.is_terminated()
    text = sample["text"]
    if kind == "choice":
        assert text in CHOICES
    elif kind == "regex":
        assert re.fullmatch(REGEX, text)
    elif kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert isinstance(json.loads(text), dict)


def samples(output: dict) -> list[dict]:
    return output.get("outputs") or [output]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_every_constraint_holds_in_every_sampling_mode(llm, reference, kind, mode):
    params = SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[kind], **MODES[mode])
    outs = samples(llm.generate([PROMPT], params, use_tqdm=False)[0])
    assert len(outs) == params.n
    for sample in outs:
        check_sample(reference, kind, sample)
    # A random model under these constraints finishes well within MAX_TOKENS (enum, bounded ints, short regex).
    if kind != "json_object":
        assert any(s["finish_reason"] == "stop" for s in outs)


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_speculative_decoding_keeps_the_grammar_and_greedy_output(llm, spec_llm, reference, kind):
    """n-gram proposals over a prompt that repeats the constraint's own text: greedy output under
    the grammar is exactly the plain engine's (a forbidden proposal is rejected, the token in its
    place masked), and sampled output still obeys it."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[kind])
    before = spec_llm.scheduler.stats.spec_proposed_tokens
    spec_out = spec_llm.generate([PROMPT], greedy, use_tqdm=False)[0]
    plain_out = llm.generate([PROMPT], greedy, use_tqdm=False)[0]
    assert spec_out["token_ids"] == plain_out["token_ids"]
    check_sample(reference, kind, spec_out)
    sampled = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[kind])
    for sample in samples(spec_llm.generate([PROMPT], sampled, use_tqdm=False)[0]):
        check_sample(reference, kind, sample)
    assert spec_llm.scheduler.stats.spec_proposed_tokens > before  # proposals were made and verified


def test_a_draft_model_proposes_under_the_grammar_too(llm, reference, qwen3_tiny):
    """Draft-model speculation (the draft is the target itself, so it proposes often): its
    proposals are masked after the tokens proposed before them, greedy output equals the plain
    engine's, and sampled output (drawn through the draft's masked q) obeys the grammar."""
    spec = {"method": "draft_model", "model": qwen3_tiny, "num_speculative_tokens": 3}
    with LLM(qwen3_tiny, kvcache_block_size=16, num_kvcache_blocks=256, speculative_config=spec) as draft_llm:
        for kind in ("regex", "json"):
            greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[kind])
            out = draft_llm.generate([PROMPT], greedy, use_tqdm=False)[0]
            assert out["token_ids"] == llm.generate([PROMPT], greedy, use_tqdm=False)[0]["token_ids"]
            check_sample(reference, kind, out)
            sampled = SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=MAX_TOKENS,
                                     structured_outputs=CONSTRAINTS[kind])
            for sample in samples(draft_llm.generate([PROMPT], sampled, use_tqdm=False)[0]):
                check_sample(reference, kind, sample)
        assert draft_llm.scheduler.stats.spec_accepted_tokens > 0


def test_grammar_mask_rejects_a_forbidden_proposal_and_masks_the_token_in_its_place(llm):
    """The rejection sampler over rows whose logits favour a token the grammar forbids, proposed:
    rejected (greedy and sampled), and the token emitted instead is one the grammar allows."""
    tokenizer = llm.tokenizer
    grammars = GrammarCompiler(tokenizer, llm.config.hf_config.vocab_size, llm.config.eos)
    compiled = grammars.compile(StructuredOutputsParams(choice=["abc"]))
    allowed_first = tokenizer.encode("a")[0]
    forbidden = tokenizer.encode("z")[0]
    vocab = llm.config.hf_config.vocab_size
    for temperature in (0.0, 1.0):
        seq = Sequence(0, tokenizer.encode("hi"), SamplingParams(temperature=temperature, seed=0), 16)
        seq.grammar = grammars.new_state(compiled)
        logits = torch.zeros(2, vocab)
        logits[:, forbidden] = 50.0  # the model is sure of the forbidden token
        t = prepare_sampling([seq, seq], vocab, llm.config.eos, torch.device("cpu"), drafts=[[], [forbidden]])
        verdicts = RejectionSampler(inverse_transform_draw)(logits, torch.tensor([forbidden, -1]), None, t)
        assert verdicts.accepted[0] is False
        matcher = xgrammar.GrammarMatcher(compiled)
        assert matcher.accept_token(verdicts.tokens[0]) and verdicts.tokens[0] != forbidden
        # The matcher was rolled back after the draft row: it still accepts the first token.
        seq.grammar.accept(allowed_first)


def allowed_ids(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    return {t for t in range(vocab) if bitmask[row, t // 32] >> (t % 32) & 1}


def test_the_mask_after_a_draft_is_the_grammars_and_the_matcher_rolls_back(llm):
    tokenizer, vocab = llm.tokenizer, llm.config.hf_config.vocab_size
    grammars = GrammarCompiler(tokenizer, vocab, llm.config.eos)
    state = grammars.new_state(grammars.compile(StructuredOutputsParams(choice=["ab", "ac"])))
    a, b, c, z = (tokenizer.convert_tokens_to_ids(ch) for ch in "abcz")
    bitmask = torch.full((3, (vocab + 31) // 32), -1, dtype=torch.int32)
    state.fill_bitmask(bitmask, 0)
    state.fill_bitmask(bitmask, 1, [a])
    state.fill_bitmask(bitmask, 2, [z])  # a draft the grammar forbids: the row is left all allowed
    assert a in allowed_ids(bitmask, 0, vocab) and z not in allowed_ids(bitmask, 0, vocab)
    after_a = allowed_ids(bitmask, 1, vocab)
    assert {b, c} <= after_a and a not in after_a and z not in after_a
    assert len(allowed_ids(bitmask, 2, vocab)) == vocab
    state.accept(a)  # the drafts were rolled back: the matcher is still at the start
    state.accept(c)
    state.accept(llm.config.eos)
    assert state.is_terminated


@pytest.mark.parametrize("bad, field", [
    (dict(json={"type": "bogus"}), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar='root ::= "x'), "structured_outputs.grammar"),
])
def test_a_constraint_that_does_not_compile_is_refused_before_any_work(llm, bad, field):
    good = SamplingParams(max_tokens=2, temperature=0.0)
    with pytest.raises(ValueError, match=re.escape(field) + " could not be compiled: .+"):
        llm.generate(["hi", "there"], [good, SamplingParams(max_tokens=2, structured_outputs=bad)], use_tqdm=False)
    assert not llm.has_unfinished_requests()  # nothing of the call was queued


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one of json, regex, choice, grammar, json_object"),
    (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(json="{not json"), "structured_outputs.json='{not json' is not JSON"),
    (dict(json=[1]), "structured_outputs.json"),
    (dict(choice=["a", ""]), "structured_outputs.choice"),
    (dict(regex=""), "structured_outputs.regex"),
    (dict(json_object="yes"), "structured_outputs.json_object"),
])
def test_structured_outputs_params_are_checked_when_made(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_a_dict_and_refuse_min_tokens_and_unknown_fields():
    assert sampling_params_module.StructuredOutputsParams is StructuredOutputsParams
    params = SamplingParams(structured_outputs={"json": '{"type": "object"}'})
    assert params.structured_outputs == StructuredOutputsParams(json={"type": "object"})
    assert params.processors[0] == "structured_outputs" and params.reads_output_tokens
    with pytest.raises(ValueError, match="unknown: \\['schema'\\]"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="min_tokens=2 is not allowed"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})


def _sentencepiece_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace "▁" words, byte fallback), as Llama 2's and Mistral's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from nanovllm.testing.synthetic import CORPUS
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    byte_pieces = [f"<0x{i:02X}>" for i in range(256)]
    tokenizer.train_from_iterator(CORPUS.split("\n\n"), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "</s>", *byte_pieces], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>")


def _wordpiece_tokenizer(cleanup: bool = True):
    """BERT's layout; its decoder cleans up (" ." -> "."), as BERT's does, unless told not to."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from nanovllm.testing.synthetic import CORPUS
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(cleanup=cleanup)
    tokenizer.train_from_iterator(CORPUS.split("\n\n"), trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[UNK]", "[SEP]"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="[SEP]")


@pytest.mark.parametrize("text", ["the quick fox", '{"a": 12, "b": [true]}'])
def test_a_sentencepiece_vocabulary_spells_what_the_grammar_says(text):
    """Walk the grammar (each step: a random allowed token, never end-of-text until it is the only
    one): the tokens decode to exactly the constrained text, "▁" words and byte pieces included."""
    tokenizer = _sentencepiece_tokenizer()
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    grammars = GrammarCompiler(tokenizer, vocab, eos)
    state = grammars.new_state(grammars.compile(StructuredOutputsParams(choice=[text])))
    generator = torch.Generator().manual_seed(0)
    tokens = []
    while True:
        bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
        state.fill_bitmask(bitmask, 0)
        allowed = sorted(allowed_ids(bitmask, 0, vocab) - {eos})
        if not allowed:
            break
        tokens.append(allowed[int(torch.randint(len(allowed), (), generator=generator))])
        state.accept(tokens[-1])
    state.accept(eos)
    assert state.is_terminated and tokenizer.decode(tokens) == text


def _walk(grammars: GrammarCompiler, params: StructuredOutputsParams, vocab: int, eos: int, seed: int = 0,
          limit: int = 40) -> list[int]:
    """Tokens the grammar allows, a random one per step (never end-of-text until it is the only one)."""
    state = grammars.new_state(grammars.compile(params))
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    while len(tokens) < limit:
        bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
        state.fill_bitmask(bitmask, 0)
        allowed = sorted(allowed_ids(bitmask, 0, vocab) - {eos})
        if not allowed:
            state.accept(eos)
            assert state.is_terminated
            break
        tokens.append(allowed[int(torch.randint(len(allowed), (), generator=generator))])
        state.accept(tokens[-1])
    return tokens


@pytest.mark.parametrize("cleanup", [True, False])
@pytest.mark.parametrize("constraint", [dict(choice=["the next request runs ."]), dict(regex=r"[a-z]+( [a-z]+){1,3}"),
                                        dict(regex="[0-9]{3,5}")])
def test_a_wordpiece_vocabulary_spells_what_the_grammar_says(constraint, cleanup, seed=3):
    """WordPiece: a word token adds " word" after other text, a "##" piece glues on. The grammar
    walks those texts, the request's text is their concatenation, and it is what the tokenizer
    itself decodes after a prompt (with its cleanup off; cleanup would turn " ." into ".")."""
    tokenizer = _wordpiece_tokenizer(cleanup)
    vocab, eos = len(tokenizer) + 5, tokenizer.eos_token_id  # a model's vocabulary may be padded past the tokenizer's
    grammars = GrammarCompiler(tokenizer, vocab, eos)
    tokens = _walk(grammars, StructuredOutputsParams(**constraint), vocab, eos, seed)
    text = grammars.text_tokenizer().decode(tokens)
    if "choice" in constraint:
        assert text == constraint["choice"][0]
    else:
        assert re.fullmatch(constraint["regex"], text), text
    prompt = tokenizer.encode("the cache serves")
    if not cleanup:
        assert tokenizer.decode(prompt + tokens) == tokenizer.decode(prompt) + text


def test_a_grammar_the_vocabulary_cannot_spell_fails_with_the_reason():
    """This WordPiece vocabulary has "{" only as a word (" {"), never glued on: an output that must
    start with "{" has no token to start with, and filling its mask says so (the sample fails alone)."""
    tokenizer = _wordpiece_tokenizer()
    grammars = GrammarCompiler(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    state = grammars.new_state(grammars.compile(StructuredOutputsParams(choice=["{}"])))
    with pytest.raises(ValueError, match="structured_outputs: no token of this tokenizer"):
        state.fill_bitmask(torch.full((1, (len(tokenizer) + 31) // 32), -1, dtype=torch.int32), 0)


def test_wordpiece_outputs_keep_their_grammar_through_the_engine(qwen3_tiny, tmp_path):
    """The engine with a WordPiece tokenizer (its decoder cleaning up, as BERT's does): choice and
    regex hold in the returned text under greedy and seeded n=2 sampling, " ." included (the
    tokenizer's own decode would clean it to "."); a constraint the vocabulary cannot spell fails
    its own request alone."""
    import shutil
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{qwen3_tiny}/{name}", tmp_path)
    _wordpiece_tokenizer().save_pretrained(tmp_path)
    regex = r"( [a-z]+){2,4}"
    choices = ["the next request runs .", "a cache hit"]
    with LLM(str(tmp_path), kvcache_block_size=16, num_kvcache_blocks=64) as engine:
        params = [SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=dict(choice=choices)),
                  SamplingParams(max_tokens=24, temperature=1.0, seed=5, n=2, structured_outputs=dict(regex=regex)),
                  SamplingParams(max_tokens=24, structured_outputs=dict(choice=["{}"])),
                  SamplingParams(max_tokens=8, temperature=0.0)]
        chosen, spelled, unspellable, free = engine.generate(["the cache"] * 4, params, use_tqdm=False)
    assert chosen["text"] in choices and chosen["finish_reason"] == "stop"
    for sample in spelled["outputs"]:
        assert sample["finish_reason"] == "length" or re.fullmatch(regex, sample["text"]), sample
        assert re.fullmatch(r"( [a-z]+)*( [a-z]*)?", sample["text"])  # every prefix of a match
    assert "structured_outputs: no token of this tokenizer" in unspellable["error"]
    assert len(free["token_ids"]) == 8 and "error" not in free


def test_the_overlapped_loop_steps_plainly_while_a_grammar_is_live(qwen3_tiny, reference):
    """async_scheduling builds step N+1's sampling inputs before step N's tokens reach the host;
    a grammar's mask needs them, so the engine keeps to the plain loop while one is live (else
    the mask would lag a token and the matcher refuse the next one). Unconstrained requests in
    the same call are unaffected."""
    with LLM(qwen3_tiny, kvcache_block_size=16, num_kvcache_blocks=256, async_scheduling="on") as engine:
        plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        outs = engine.generate([PROMPT, PROMPT, "Hello"], [
            SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS["json"]),
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS["regex"]), plain],
            use_tqdm=False)
        check_sample(reference, "json", outs[0])
        check_sample(reference, "regex", outs[1])
        assert len(outs[2]["token_ids"]) == 16
        assert engine.generate(["Hello"], plain, use_tqdm=False)[0]["token_ids"] == outs[2]["token_ids"]


def test_the_mask_kernels_of_both_devices_agree():
    """GrammarMask uses xgrammar's C++ kernel on the CPU and its plain-torch one elsewhere: on the
    same bits (here, on the CPU) they mask the same logits, and only the constrained rows."""
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 20), dtype=torch.int32, generator=generator)
    logits = torch.randn(4, 630, generator=generator)  # a vocabulary that does not fill the last word
    masked = {}
    for backend in ("cpu", "torch_native"):
        masked[backend] = logits.clone()
        xgrammar.apply_token_bitmask_inplace(masked[backend], bitmask, vocab_size=630, indices=[0, 2], backend=backend)
    assert torch.equal(masked["cpu"], masked["torch_native"])
    assert torch.equal(masked["cpu"][[1, 3]], logits[[1, 3]]) and masked["cpu"][0].isinf().any()
