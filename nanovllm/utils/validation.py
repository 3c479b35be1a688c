"""The checks user input goes through, shared by Config and SamplingParams (and the engine's
prompt checks): one wording for every refusal, a `ParamError` (a ValueError) naming the field,
the value and what is allowed, and carrying the field's name as `.param` so a caller (the
server's 400, a batch job's error line) can say which field without reading the message.
Plain Python."""
import math
import types
import typing


class ParamError(ValueError):
    """Bad input for one field: `param` is its name as the caller gave it ("top_p",
    "speculative_config['method']"); the message says the value and what is allowed."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # crosses to and from the engine process whole
        return ParamError, (self.param, str(self))


def require(ok: bool, name: str, value: object, allowed: str) -> None:
    """Refuse `value` for `name` unless `ok`; `allowed` says what would be accepted."""
    if not ok:
        raise ParamError(name, f"{name}={shown(value)} is not allowed; {name} must be {allowed}")


# A refused value is quoted up to this many characters: enough to recognise it, and a 10 MB
# prompt or a 400-digit integer does not become a 10 MB message.
MAX_SHOWN_CHARS = 120


def shown(value: object) -> str:
    """repr(value), cut to MAX_SHOWN_CHARS."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "..."


def is_int(value: object) -> bool:
    """An int and not a bool (True is an int to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite int or float, not a bool (an int too large for a float is not one either)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range, e.g. 10**400
        return False


def first_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in `text` (which no UTF-8 text holds, though JSON's
    "\\ud800" escape makes one), or None when the text is valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def literal_values(annotation: object) -> tuple | None:
    """The values a `Literal[...]` type allows, also as a member of a union (`torch.dtype |
    Literal[...]`, `Literal[...] | None`); None for any other type."""
    union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    for arg in typing.get_args(annotation) if union else (annotation,):
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)
    return None
