"""Turning a caller's input into requests: every check on a call (prompts, sampling params,
priorities, request ids, chat conversations), tokenizing text, and building each request's
sequences. Every way in uses it (generate/stream/chat, and add_requests, which the server and
batch jobs call), so each refuses the same input with the same ValueError, naming the field,
the value and what is allowed, and the prompt's index when the call has several. Nothing is
queued here: a call is built in full before any of it is submitted.

Checking is `admit` (tokenize, check, compile the constraint), building is the rest. The server
admits a request in its prompt thread with a builder of its own (`AdmittedPrompt`), and the
engine builds what was admitted without checking or compiling it again.

A fault that is not bad input (a tokenizer or detokenizer raising on valid input) fails its
request alone: it is built already failed (`Request.fault`), and its caller gets its error
output. It knows nothing of scheduling, the model or tensors.
"""
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import count
from typing import Collection, Protocol

from transformers import PreTrainedTokenizerBase

from nanovllm.engine.chat import ChatOptions, render_chat
from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.engine.request import Request
from nanovllm.scheduling.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm.utils.math_utils import cdiv
from nanovllm.utils.validation import ParamError, first_surrogate, is_int, shown

Prompt = str | list[int]


class GrammarSource(Protocol):
    """What builds a request's grammar matchers (structured_outputs/compiler.py, GrammarCompiler,
    which this torch-free module does not import: xgrammar imports torch)."""

    def compile(self, params: StructuredOutputsParams) -> object: ...

    def new_state(self, compiled: object) -> object: ...

    def text_tokenizer(self) -> object | None: ...


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str, name: str, **kwargs) -> list[int]:
    """Tokenize a caller's text: lone surrogates (JSON's "\\ud800", which no UTF-8 text holds)
    are refused, not replaced, and any tokenizer error is a ValueError naming the field."""
    bad = first_surrogate(text)
    if bad is not None:
        raise ParamError(name, f"{name} has a lone surrogate (U+{ord(text[bad]):04X}) at index {bad}; {name} must be "
                         "valid Unicode text")
    try:
        return tokenizer.encode(text, **kwargs)
    except Exception as exc:
        raise ParamError(name, f"{name}={shown(text)} could not be tokenized; {name} must be text the tokenizer "
                         "accepts") from exc


@dataclass(frozen=True, eq=False)
class AdmittedPrompt:
    """A prompt `RequestBuilder.admit` accepted with its params: its token ids and its compiled
    constraint (None without one). Built with those params, it is not checked again. A compiled
    grammar does not cross to an engine process (it does not pickle, and xgrammar's serialized
    form costs more than compiling): an admitted prompt arrives there without it, and its
    constraint is compiled where it is built."""
    token_ids: list[int]
    params: SamplingParams
    grammar: object | None = None
    text: str | None = None  # the prompt as given, when it was text

    def __reduce__(self):
        return AdmittedPrompt, (self.token_ids, self.params, None, self.text)


@contextmanager
def _naming(i: int, total: int, name: str) -> Iterator[None]:
    """A refusal of one of several prompts says which (the message still opens with the field at fault)."""
    try:
        yield
    except ValueError as exc:
        if total > 1:
            exc.args = (f"{exc.args[0] if exc.args else exc} ({name}[{i}])", *exc.args[1:])
        raise


class RequestBuilder:
    """Checks and builds the requests of one engine: its tokenizer (None: token ids only), its
    vocabulary and context length, and the KV cache a request must fit in."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, max_model_len: int,
                 block_size: int, num_blocks: int, grammars: "GrammarSource | None" = None):
        self.tokenizer = tokenizer
        self.grammars = grammars  # compiles structured_outputs constraints (None: refused)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._seq_ids = count()

    def build_all(self, prompts: list[Prompt | AdmittedPrompt], sampling_params: SamplingParams | list[SamplingParams],
                  deltas: bool = False, priority: list[int] | None = None,
                  request_ids: list[str | None] | None = None, live: Collection[str] = (),
                  name: str = "prompts") -> list[Request]:
        """Check a whole call and build its requests (one per prompt, in order), or raise a
        ValueError; an admitted prompt is built as admitted. With `deltas`, every sample
        detokenizes as it goes (for stream() and pop_output()). `live`: the request ids in use,
        which a given id must not repeat."""
        if not isinstance(prompts, (list, tuple)):
            raise ParamError("prompt", f"prompts={prompts!r:.80} is not allowed; prompts must be a list of str or of token-id lists")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ParamError("sampling_params", f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts; "
                                 "give one per prompt or a single SamplingParams")
        else:
            sampling_params = [sampling_params] * len(prompts)
        if priority is None:
            priority = [0] * len(prompts)
        elif not isinstance(priority, (list, tuple)) or len(priority) != len(prompts):
            raise ParamError("priority", f"priority={priority!r:.80} is not allowed; give a list of one int per prompt "
                             f"({len(prompts)}), or None for all 0")
        if request_ids is None:
            request_ids = [None] * len(prompts)
        elif not isinstance(request_ids, (list, tuple)) or len(request_ids) != len(prompts):
            raise ParamError("request_ids", f"request_ids={request_ids!r:.80} is not allowed; give a list of one id (a str, or None "
                             f"for a new one) per prompt ({len(prompts)}), or None")
        requests, taken = [], set()
        for i, (prompt, params, pr, request_id) in enumerate(zip(prompts, sampling_params, priority, request_ids)):
            with _naming(i, len(prompts), name):
                self._check_request_id(request_id, live, taken)
                requests.append(self.build(i, prompt, params, deltas, request_id, pr))
        return requests

    def admit_all(self, prompts: list[list[int]], params: SamplingParams, grammar: object | None = None,
                  name: str = "prompts") -> list[AdmittedPrompt]:
        """admit() each prompt of a call with the same params (and the grammar compiled from them)."""
        admitted = []
        for i, prompt in enumerate(prompts):
            with _naming(i, len(prompts), name):
                admitted.append(self.admit(prompt, params, grammar))
        return admitted

    @staticmethod
    def _check_request_id(request_id: str | None, live: Collection[str], taken: set[str]) -> None:
        if request_id is None:
            return
        if not isinstance(request_id, str) or not request_id:
            raise ParamError("request_id", f"request_id={request_id!r} is not allowed; it must be None or a non-empty str")
        if request_id in live or request_id in taken:
            raise ParamError("request_id", f"request_id={request_id!r} is already a live request; request ids must be unique")
        taken.add(request_id)

    def build(self, index: int, prompt: Prompt | AdmittedPrompt, params: SamplingParams,
              deltas: bool = False, request_id: str | None = None, priority: int = 0) -> Request:
        """_make, where a fault other than bad input (a ValueError, which refuses the call)
        fails this request alone: it is built already failed and fails once submitted."""
        try:
            return self._make(index, prompt, params, deltas, request_id, priority)
        except ValueError:
            raise
        except Exception as exc:
            if isinstance(prompt, AdmittedPrompt):
                token_ids, text = prompt.token_ids, prompt.text
            else:
                token_ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
                text = prompt if isinstance(prompt, str) else None
            seqs = [Sequence(next(self._seq_ids), token_ids, params, self.block_size, priority=priority)
                    for _ in range(params.n)]
            for seq in seqs:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            request = Request(index, token_ids, params, seqs, request_id, text)
            request.fault = exc
            return request

    def _make(self, index: int, prompt: Prompt | AdmittedPrompt, params: SamplingParams,
              deltas: bool, request_id: str | None, priority: int) -> Request:
        """Check one prompt (unless it was admitted already) and build its sequences."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ParamError("priority", f"priority={priority!r} is not allowed; a priority must be an int (lower runs first)")
        if not isinstance(prompt, AdmittedPrompt):
            prompt = self.admit(prompt, params)
        elif prompt.params != params:
            raise ParamError("sampling_params", "an admitted prompt is built with the sampling params it was admitted "
                             "with; give those, or the prompt itself")
        elif params.structured_outputs and prompt.grammar is None:  # admitted in another process
            prompt = replace(prompt, grammar=self.grammars.compile(params.structured_outputs))
        token_ids, grammar = prompt.token_ids, prompt.grammar
        # A constrained request's text is the grammar's text: some vocabularies decode it themselves.
        own_decoder = self.grammars.text_tokenizer() if grammar is not None else None
        seqs = []
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), token_ids, params, self.block_size, priority=priority)
            seq.seed = None if params.seed is None else params.seed + i
            if i > 0:  # the prompt's logprobs are the request's: sample 0 computes them
                seq.prompt_logprobs = None
            seq.grammar = None if grammar is None else self.grammars.new_state(grammar)  # one matcher per sample
            # generate() decodes a sample's text once, at the end, unless stop strings need it on the
            # way. A sample with a detokenizer reports each new token to its caller (LLMEngine._report):
            # so every sample of stream() and add_requests() does.
            if deltas or params.stop_strings:
                seq.detokenizer = Detokenizer(own_decoder or self.tokenizer, params, token_ids)
            seqs.append(seq)
        return Request(index, token_ids, params, seqs, request_id, prompt.text, own_decoder)

    def admit(self, prompt: Prompt, params: SamplingParams, grammar: object | None = None) -> AdmittedPrompt:
        """Check one prompt with its params and compile their constraint (`grammar`: compiled from
        them already), or raise a ValueError naming the field."""
        if not isinstance(params, SamplingParams):
            raise ParamError("sampling_params", f"sampling_params={params!r} is not allowed; it must be a SamplingParams")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParamError("prompt", f"prompt={prompt!r:.80} is a string, but this engine has no tokenizer "
                                 "(skip_tokenizer_init=True); give each prompt as a list of token ids")
            token_ids = encode_text(self.tokenizer, prompt, "prompt")
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            token_ids = list(prompt)
        else:
            raise ParamError("prompt", f"prompt={prompt!r:.80} is not allowed; a prompt must be a str or a list of int token ids")
        if not token_ids:
            raise ParamError("prompt", f"prompt={prompt!r} is empty; a prompt needs at least one token")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ParamError("prompt", f"prompt token id {bad} is outside the vocabulary; token ids must be in "
                             f"[0, {self.vocab_size})")
        if params.structured_outputs and (self.tokenizer is None or self.grammars is None):
            raise ParamError("structured_outputs", "structured_outputs needs the tokenizer's vocabulary to compile "
                             "its constraint, but this engine has none (skip_tokenizer_init=True)")
        if params.stop_strings and self.tokenizer is None:
            raise ParamError("stop", f"stop={list(params.stop_strings)!r} needs a tokenizer to find the strings in the text, "
                             "but this engine has none (skip_tokenizer_init=True); use stop_token_ids instead")
        params.check_vocabulary(self.vocab_size)
        max_len = self.max_model_len
        if len(token_ids) > max_len:
            raise ParamError("prompt", f"prompt length {len(token_ids)} is longer than max_model_len={max_len}")
        # The longest this sequence can grow must fit in the whole cache, or it could never run.
        bs = self.block_size
        needed = cdiv(min(len(token_ids) + params.max_tokens, max_len), bs)
        if needed > self.num_blocks:
            raise ParamError("max_tokens", f"a request of {len(token_ids)} prompt tokens and max_tokens={params.max_tokens} "
                             f"needs {needed} KV blocks of {bs} tokens, more than the whole cache "
                             f"({self.num_blocks} blocks); shorten it or enlarge the cache")
        # Compiled once per request (xgrammar caches it: the other prompts of a call find it); a
        # constraint that does not compile is a ParamError naming it, before anything is queued.
        if params.structured_outputs and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        return AdmittedPrompt(token_ids, params, grammar, prompt if isinstance(prompt, str) else None)

    def chat_prompts(self, messages: list[dict] | list[list[dict]], options: ChatOptions) -> list[list[int]]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, checked and
        rendered by the tokenizer's chat template, as token ids."""
        if self.tokenizer is None:
            raise ParamError("messages", "chat() needs the tokenizer's chat template, but this engine has no tokenizer "
                             "(skip_tokenizer_init=True); render the conversation yourself and call generate() "
                             "with token ids")
        if not isinstance(messages, list) or not messages:
            raise ParamError("messages", "messages must be a non-empty list of {'role', 'content'} dicts, or a list of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        for conversation in conversations:
            # content may be None only in an assistant message that made tool calls (OpenAI's shape)
            if not isinstance(conversation, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and (isinstance(m.get("content"), str) or (
                        m.get("content") is None and m["role"] == "assistant" and m.get("tool_calls")))
                    for m in conversation):
                raise ParamError("messages", f"conversation {conversation!r:.80} is not allowed; it must be a list of "
                                 "{'role': str, 'content': str} dicts (content None only in an assistant message "
                                 "with tool_calls)")
            for m in conversation:
                bad = first_surrogate(m["role"] + (m["content"] or ""))
                if bad is not None:
                    raise ParamError("messages", f"messages has a lone surrogate in {m!r:.80}; messages must be valid "
                                     "Unicode text")
        return [render_chat(self.tokenizer, c, options) for c in conversations]
