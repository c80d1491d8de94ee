"""What the data-parallel wrapper needs (Megatron-Core's DistributedDataParallelConfig).

The CLI layer fills it by copying same-named flags (``megatron.config.core_configs.ddp_config``);
library users construct it directly.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(kw_only=True)
class DistributedDataParallelConfig:
    """Gradient buffers, their reduction and the checks made before it."""

    accumulate_allreduce_grads_in_fp32: bool = False
    """Keep gradients in fp32 whatever the parameter dtype (always so with bf16)."""
    overlap_grad_reduce: bool = False
    """Reduce bucket by bucket during the backward of the last micro-batch."""
    use_distributed_optimizer: bool = False
    """Pad the buffers to a multiple of the DP size and reduce-scatter them (ZeRO-1)."""
    use_contiguous_buffers_in_local_ddp: bool = True
    """False keeps the gradients in ``param.grad`` and all-reduces them per dtype through a
    temporary flattened copy (Megatron-LM 23.06's ``--no-contiguous-buffers-in-local-ddp``);
    fp32 accumulation, overlap and the distributed optimizer need the buffer."""
    check_for_nan_in_grad: bool = False
    """Record whether the local gradients are finite before each reduction (one sum over the
    buffer; read with ``local_grads_finite``)."""

    def __post_init__(self) -> None:
        if not self.use_contiguous_buffers_in_local_ddp and (
                self.accumulate_allreduce_grads_in_fp32 or self.overlap_grad_reduce
                or self.use_distributed_optimizer):
            raise ValueError("fp32 grad accumulation, overlapped reduction and the distributed "
                             "optimizer need the contiguous gradient buffer")
