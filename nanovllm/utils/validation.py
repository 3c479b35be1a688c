"""The checks user input goes through, shared by Config and SamplingParams (and the engine's
prompt checks): one wording for every refusal, a ValueError naming the field, the value and
what is allowed. Plain Python."""
import math


def require(ok: bool, name: str, value: object, allowed: str) -> None:
    """Refuse `value` for `name` unless `ok`; `allowed` says what would be accepted."""
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed; {name} must be {allowed}")


def is_int(value: object) -> bool:
    """An int and not a bool (True is an int to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
