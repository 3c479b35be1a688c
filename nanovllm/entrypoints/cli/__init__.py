"""The `nanovllm` command: sub-commands (`main`) and flags generated from dataclasses (`args`)."""
