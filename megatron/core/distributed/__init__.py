"""Data parallelism: Megatron's local DDP with contiguous gradient buffers, and its helpers.

Public API: :class:`DistributedDataParallel` (``--DDP-impl local``),
:class:`TorchDistributedDataParallel` (``--DDP-impl torch``), :func:`finalize_model_grads`,
:func:`allreduce_sequence_parallel_grads`.
"""

from megatron.core.distributed.config import DistributedDataParallelConfig
from megatron.core.distributed.ddp import (DEFAULT_BUCKET_SIZE, DistributedDataParallel,
                                           TorchDistributedDataParallel)
from megatron.core.distributed.finalize_model_grads import (allreduce_sequence_parallel_grads,
                                                           finalize_model_grads)
from megatron.core.distributed.grad_buffer import GradBuffer

__all__ = ["DEFAULT_BUCKET_SIZE", "DistributedDataParallel", "DistributedDataParallelConfig",
           "TorchDistributedDataParallel",
           "GradBuffer", "allreduce_sequence_parallel_grads", "finalize_model_grads"]
