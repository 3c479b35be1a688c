"""Per-request sampling settings, validated when they are made.

temperature 0 means greedy (argmax); nano-vllm forbids it, vLLM users expect it.
"""
import math
from dataclasses import dataclass


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r} is not allowed; temperature must be a finite number >= 0 "
                             "(0 means greedy)")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_tokens={m!r} is not allowed; max_tokens must be an integer >= 1")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} is not allowed; ignore_eos must be True or False")
        self.temperature = float(t)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
