"""Where nanovllm keeps files it makes for the user: one cache directory, the XDG one.

Owns `cache_dir()`: $XDG_CACHE_HOME/nanovllm when that is set to an absolute path (the XDG Base
Directory rule: a relative one is ignored), else ~/.cache/nanovllm. Generated checkpoints
(bench.py's synthetic models, the demo model) live under it, never in whatever directory a
command runs from. It creates nothing; callers make the subdirectory they write.
"""
import os
from pathlib import Path

CACHE_NAME = "nanovllm"


def cache_dir() -> Path:
    """The user's nanovllm cache directory (not created here)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / CACHE_NAME
