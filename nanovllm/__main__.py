"""`python -m nanovllm ...` is the `nanovllm` command (nanovllm/entrypoints/cli/main.py)."""
import sys

from nanovllm.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
