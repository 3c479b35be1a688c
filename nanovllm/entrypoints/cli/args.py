"""Command-line flags generated from a dataclass: one `--flag-name` per field, with the field's
type, default and help (the comment on or just above the field in its source).

So the CLI cannot drift from `Config` or `SamplingParams`: a new field is a new flag. A field
typed with a `Literal` (Config's `Device`, `KvCacheDtype`, ...) gets its values as the flag's
choices, listed in --help; a field whose metadata has "cli_hidden" (config.py, CLI_HIDDEN) is
still a flag but is left out of --help. It knows nothing of what the fields mean.
"""
import argparse
import ast
import dataclasses
import inspect
import io
import json
import textwrap
import tokenize
import types
import typing
from typing import Any, Callable, NamedTuple

from nanovllm.utils.validation import literal_values

SCALARS = (bool, int, float, str)
# A field's metadata key: the flag is taken but not listed in --help.
CLI_HIDDEN_KEY = "cli_hidden"


class FlagType(NamedTuple):
    scalar: Callable  # what parses one value (a scalar type, or json_object)
    is_list: bool
    optional: bool  # None is allowed
    choices: tuple | None  # a Literal's values


def json_object(text: str) -> dict:
    """A `dict` field's flag value: a JSON object, as vLLM's `--speculative-config '{...}'`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment in the class source: the comment at the end of its line, else
    the block of comment lines right above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}  # line number -> comment text
    code_lines: set[int] = set()  # lines holding code (a comment there is an inline one)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.add(tok.start[0])
    result = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if node.end_lineno in comments:
            result[node.target.id] = comments[node.end_lineno]
            continue
        above, line = [], node.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        if above:
            result[node.target.id] = " ".join(above)
    return result


def _flag_type(annotation: Any) -> FlagType:
    """How to parse a field annotated as `int | None`, `str | torch.dtype` (the first scalar wins),
    `str | list[str] | None`, `dict | None` (a JSON object) or `Literal[...]` (its values are the
    choices; `torch.dtype | Literal[...]` too)."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or \
        typing.get_origin(annotation) is typing.Union else (annotation,)
    optional = type(None) in args
    if any(arg is dict or typing.get_origin(arg) is dict for arg in args):
        return FlagType(json_object, False, optional, None)
    values = literal_values(annotation)
    if values is not None:
        return FlagType(type(values[0]), False, optional, values)
    scalar = next((arg for arg in args if arg in SCALARS), None)
    for arg in args:
        if typing.get_origin(arg) in (list, tuple) and typing.get_args(arg)[0] in SCALARS:
            return FlagType(scalar or typing.get_args(arg)[0], True, optional, None)
    if scalar is None:
        raise TypeError(f"no command-line type for annotation {annotation!r}")
    return FlagType(scalar, False, optional, None)


def add_dataclass_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                        skip: tuple[str, ...] = (), choices: dict[str, tuple] | None = None) -> list[str]:
    """Add a flag for every init field of `cls` not in `skip`; returns the field names added.
    `choices` overrides a field's (from its Literal type) or gives one a Literal does not."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    choices = choices or {}
    added = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name in skip:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = _flag_type(hints[f.name])
        help_text = comments.get(f.name, f"{cls.__name__}.{f.name}")
        kwargs: dict[str, Any] = {"dest": f.name, "default": default}
        if flag.scalar is bool and not flag.is_list:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = flag.scalar
            kwargs["metavar"] = f.name.upper()
            if flag.is_list:
                kwargs["nargs"] = "+"
            allowed = choices.get(f.name, flag.choices)
            if allowed is not None:
                kwargs["choices"] = allowed
                kwargs.pop("metavar")
        none_note = " (default: none)" if flag.optional and default is None else " (default: %(default)s)"
        kwargs["help"] = help_text.replace("%", "%%") + none_note
        if f.metadata.get(CLI_HIDDEN_KEY):
            kwargs["help"] = argparse.SUPPRESS
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)
        added.append(f.name)
    return added


def dataclass_kwargs(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """The values of the flags added for `names`, as keyword arguments of the dataclass."""
    return {name: getattr(args, name) for name in names}
