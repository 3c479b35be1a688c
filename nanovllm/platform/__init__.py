"""The platform layer: everything that depends on the device or the CPU's ISA, behind one
interface chosen once at start-up. Nothing outside this package branches on the device or
imports a kernel module (tests/test_layering.py).

base.py is the interface (`Platform`, `LinearMethod`); torch.py the reference (plain torch, the
oracle); triton.py the Triton kernels (CUDA, or the CPU's interpreter in tests); cpu/ the CPU's
(oneDNN packing, the C++ kernels, the one-call decode step, the greedy heads). choose.py picks one
from the config; context.py hands it to the layers while a model is built; attention.py chooses
the attention backend; sampling.py is the sampler of the platforms with a race kernel. This file
imports nothing, so that naming the interface loads no implementation.
"""
