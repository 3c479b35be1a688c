"""The platform layer: everything that depends on the device or the CPU's ISA, behind one
interface chosen once at start-up. Nothing outside this package branches on the device or
imports a kernel module (tests/test_layering.py)."""
