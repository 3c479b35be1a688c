"""`python -m nanovllm ...` is the `nanovllm` command (nanovllm/entrypoints/cli.py)."""
import sys

from nanovllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
