"""Chat rendering: a conversation through the tokenizer's chat template, as prompt token ids.

The one place a conversation becomes a prompt. `LLM.chat`, the HTTP server's chat endpoint, the
batch job's chat lines and the CLI's `chat` command all call `render_chat` with a `ChatOptions`
that carries what a request may say about its rendering (vLLM's field names). A template's own
refusal (its `raise_exception`, a missing field) is the caller's fault: `ChatTemplateError`, a
ValueError. A template that does not compile is the model's fault: `BrokenChatTemplateError`.
`load_chat_template` reads a template given in place of the checkpoint's (a file or the text).
"""
import os
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import PreTrainedTokenizerBase

from nanovllm.utils.validation import ParamError


# apply_chat_template's own arguments and the functions it hands every template
# (raise_exception, strftime_now): chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_ARGS = frozenset({"self", "conversation", "messages", "tools", "documents", "chat_template",
                                    "tokenize", "add_generation_prompt", "continue_final_message", "return_dict",
                                    "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
                                    "return_assistant_tokens_mask", "sanitize_control_tokens", "raise_exception",
                                    "strftime_now"})
# Characters that make a --chat-template value the template itself rather than a file path (vLLM's rule).
TEMPLATE_CHARS = "{}\n"


class ChatTemplateError(ValueError):
    """The chat template refused the conversation, or there is no template to render it with."""


class BrokenChatTemplateError(RuntimeError):
    """The chat template itself does not compile: the model's (or the server's) fault."""


@dataclass(frozen=True)
class ChatOptions:
    """How one conversation is rendered (the fields of vLLM's chat request that shape the prompt)."""
    add_generation_prompt: bool = True  # end with the assistant's turn opening, so the model answers
    continue_final_message: bool = False  # leave the last (assistant) message open, to be continued
    chat_template: str | None = None  # a Jinja template replacing the tokenizer's own
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra template variables
    tools: list[dict] | None = None  # function schemas handed to the template as `tools`
    documents: list[dict] | None = None  # handed to the template as `documents` (retrieval templates)
    add_special_tokens: bool = False  # the tokenizer's BOS (etc.) on top of what the template writes

    def __post_init__(self):
        taken = sorted(RESERVED_TEMPLATE_ARGS & set(self.chat_template_kwargs))
        if taken:
            raise ParamError("chat_template_kwargs", f"chat_template_kwargs={taken} is not allowed; these names are "
                             "set by the request's own fields or by the engine")
        if self.add_generation_prompt and self.continue_final_message:
            raise ParamError("add_generation_prompt", "add_generation_prompt=True and continue_final_message=True "
                             "are not allowed together; continuing the final message must not open a new "
                             "assistant turn")


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                options: ChatOptions = ChatOptions()) -> list[int]:
    """`messages` rendered as the prompt's token ids (the template holds any special tokens, so
    none are added again unless `options.add_special_tokens`)."""
    return tokenizer.encode(render_chat_text(tokenizer, messages, options),
                            add_special_tokens=options.add_special_tokens)


def render_chat_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                     options: ChatOptions = ChatOptions()) -> str:
    """`messages` rendered as the prompt's text."""
    template = options.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateError("this model's tokenizer has no chat template; send a prompt instead of messages")
    if options.continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ChatTemplateError("continue_final_message=True needs the last message to be the assistant's")
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=options.chat_template, tools=options.tools, documents=options.documents,
            tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, **options.chat_template_kwargs)
    except TemplateSyntaxError as exc:
        raise BrokenChatTemplateError(f"the chat template does not compile: {exc}") from None
    except TemplateError as exc:  # the template's own refusal (raise_exception) or a missing field
        raise ChatTemplateError(f"the chat template refused these messages: {exc.message}") from None
    except Exception as exc:  # a template failing at run time (a TypeError on a value it did not expect)
        failure = f"{type(exc).__name__}: {exc}"
        if options.chat_template_kwargs or options.documents:  # the caller's variables are the likely cause
            raise ChatTemplateError(f"the chat template failed on these messages and template variables "
                                    f"({failure})") from None
        raise BrokenChatTemplateError(f"the chat template failed: {failure}") from None


def load_chat_template(value: str) -> str:
    """A chat template given in place of the checkpoint's: the file `value` names, or `value`
    itself when it holds template characters. Checked to compile (ValueError naming the problem)."""
    try:
        with open(value, encoding="utf-8") as f:
            template = f.read()
    except OSError as exc:
        if not any(c in value for c in TEMPLATE_CHARS):
            raise ParamError("chat_template", f"chat_template={value!r:.200} is not allowed: it looks like a file "
                             f"path but cannot be read ({exc.strerror}); give a readable file or the Jinja template "
                             "itself") from None
        template = value
    except UnicodeDecodeError:
        raise ParamError("chat_template", f"chat_template={value!r:.200} is not allowed: the file is not UTF-8 "
                         "text") from None
    try:  # the environment transformers renders chat templates in
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]).parse(template)
    except TemplateSyntaxError as exc:
        where = "" if os.path.isfile(value) else " (read as the template itself)"
        raise ParamError("chat_template", f"chat_template{where} does not compile: {exc.message} "
                         f"(line {exc.lineno})") from None
    return template
