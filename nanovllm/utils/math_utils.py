"""Integer arithmetic used across the layers (block counts, vocabulary padding). Plain Python."""


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: e.g. the blocks of b tokens that hold a tokens."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= a."""
    return cdiv(a, multiple) * multiple
