"""Where this process sits in the tensor-parallel group (rank 0 of 1 when there is none)."""
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
