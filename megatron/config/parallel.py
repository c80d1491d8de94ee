"""Distributed flags: parallel sizes, backend, data-parallel wrapper and optimizer sharding."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron.config.base import spec


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """How the model and the data are split over ranks."""

    tensor_model_parallel_size: int = 1
    """Number of ranks each layer is split over (tensor model parallelism)."""
    pipeline_model_parallel_size: int = 1
    """Number of pipeline stages."""
    context_parallel_size: int = 1
    """Ranks each sequence is split over (context parallelism): with causal attention rank r
    holds chunks r and 2 CP - r - 1 of the 2 CP chunks of every sequence."""
    cp_comm_type: list[str] = spec(default_factory=lambda: ["p2p"], nargs="+")
    """How attention reaches the other ranks' keys and values under context parallelism: p2p
    (a ring), all_gather (gathered once), a2a (Ulysses: all-to-all between sequence and head
    splits); one value for every layer, or one per layer (a2a+p2p is not built)."""
    expert_model_parallel_size: int = 1
    """Ranks the experts of each MoE layer are spread over (expert parallelism)."""
    expert_tensor_parallel_size: int | None = None
    """Ranks each expert is split over (default: --tensor-model-parallel-size)."""
    pipeline_model_parallel_split_rank: int | None = None
    """Pipeline stage where the decoder starts (encoder-decoder models)."""
    model_parallel_size: int | None = None
    """Deprecated: use --tensor-model-parallel-size."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per virtual pipeline stage (interleaved 1F1B schedule)."""
    overlap_p2p_comm: bool = spec(False, flag="--overlap-p2p-communication")
    """Overlap pipeline send/receive with computation (interleaved schedule)."""
    distributed_backend: Literal["nccl", "gloo"] | None = None
    """Collective backend; by default NCCL when CUDA is available, gloo otherwise
    (Megatron-LM defaults to nccl, which cannot run on a CPU)."""
    distributed_timeout_minutes: int = 10
    """Timeout of collective operations, in minutes."""
    watchdog_timeout_seconds: float | None = None
    """Not in Megatron-LM. Each rank's watchdog ends the job, naming the rank, when a rank's main
    thread has been outside any collective this long (hung), when a peer stopped its heartbeat
    for this long (dead or frozen) while this rank waits for it, or when this rank has waited in
    one collective twice this long. Set it above the longest phase a rank spends without
    collectives (index building, checkpoint writing). Default: off (the collective timeout,
    --distributed-timeout-minutes, is then the only bound)."""
    ddp_impl: Literal["local", "torch"] = spec("local", flag="--DDP-impl")
    """Data-parallel implementation: local (contiguous gradient buffer) or torch (PyTorch DDP)."""
    use_contiguous_buffers_in_local_ddp: bool = spec(
        True, flag="--no-contiguous-buffers-in-local-ddp")
    """Do not use a contiguous gradient buffer in the local DDP."""
    scatter_gather_tensors_in_pipeline: bool = spec(
        True, flag="--no-scatter-gather-tensors-in-pipeline")
    """Send whole tensors between pipeline stages instead of TP-scattered pieces."""
    use_ring_exchange_p2p: bool = False
    """Use a custom ring-exchange kernel for pipeline communication."""
    local_rank: int | None = spec(None, flag="--local_rank", aliases=("--local-rank",))
    """Local rank passed by the legacy launcher (torchrun passes LOCAL_RANK instead)."""
    lazy_mpu_init: bool | None = spec(None, argtype=lambda s: s.lower() in ("1", "true", "yes"))
    """Skip the model-parallel initialization (external launchers). Accepted for Megatron-LM
    scripts; no effect here: initialize_megatron always initializes."""
    use_cpu_initialization: bool | None = spec(None, argtype=None)
    """Draw each tensor-parallel weight whole on the CPU and keep this rank's slice, so runs at
    different TP sizes start from the same weights. Without it, on a GPU each rank draws only
    its own shard on the device from the model-parallel RNG (Megatron's default); on a CPU
    device the whole-weight draw is always used."""
    empty_unused_memory_level: Literal[0, 1, 2] = 0
    """Call the allocator's empty_cache: 0 never, 1 after each step, 2 also after evaluation."""
    standalone_embedding_stage: bool = False
    """Put the input embedding alone on the first pipeline stage."""
    use_distributed_optimizer: bool = False
    """Shard the fp32 main parameters and optimizer state over the data-parallel ranks (ZeRO-1)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass, bucket by bucket."""
    sequence_parallel: bool = False
    """Split LayerNorm and dropout activations along the sequence over TP ranks."""
    gradient_accumulation_fusion: bool = True
    """Disable fusing the weight-gradient GEMM with the accumulation into main_grad: with the
    fusion the linear layers' backward adds dY^T X straight into the DDP buffer's main_grad
    (one GEMM with beta = 1, no weight.grad tensor); without it autograd's weight.grad is
    added into main_grad by the DDP hook."""
    async_tensor_model_parallel_allreduce: bool = True
    """Disable overlapping the tensor-parallel all-reduce of the input gradient with the
    weight-gradient GEMM. Accepted for Megatron-LM scripts; no effect here: that all-reduce is
    always synchronous (same result, no overlap)."""
