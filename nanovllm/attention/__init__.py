"""Attention backends behind one interface (base.py): the torch oracle (torch_backend.py), Triton's
(triton_backend.py) and flash-attn's (flash_attn_backend.py), each handed the kernels it calls.
Which one runs is the platform's choice (platform/attention.py), made once at start-up; the CPU's
paged kernel is the CPU platform's own backend (platform/cpu/attention.py)."""
