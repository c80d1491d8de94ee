"""Small helpers shared by the tensor-parallel layers: divisibility, vocabulary ranges, splits,
and the parameter attributes that the optimizer and data-parallel code read.

Parameter attributes (as Megatron-LM sets them):

* ``tensor_model_parallel`` (bool): the parameter is a TP shard (different on each TP rank).
  False means it is replicated on all TP ranks, so grad-norm code counts it on TP rank 0 only.
* ``partition_dim``: the dimension the full weight was split along (-1 when not split).
* ``partition_stride``: interleaving stride of the split (1 = contiguous blocks).
* ``shared``: the tied word-embedding / output-layer weight.
"""

from __future__ import annotations

import torch

from megatron.core import comm

ProcessGroup = comm.ProcessGroup


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division.

    Raises:
        ValueError: ``numerator`` is not a multiple of ``denominator``.
    """
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def tp_world_size(tp_group: ProcessGroup | None) -> int:
    """Ranks in the TP group; ``None`` (this rank alone) means no tensor parallelism (size 1)."""
    return comm.world_size(tp_group)


def tp_rank(tp_group: ProcessGroup | None) -> int:
    """This rank's position in the TP group (0 when ``tp_group`` is None)."""
    return comm.rank(tp_group)


def vocab_range(per_partition_vocab_size: int, rank: int) -> tuple[int, int]:
    """The ``[first, last)`` vocabulary ids held by TP rank ``rank``."""
    first = rank * per_partition_vocab_size
    return first, first + per_partition_vocab_size


def split_along_last_dim(tensor: torch.Tensor, num_partitions: int) -> list[torch.Tensor]:
    """Split into ``num_partitions`` equal views along the last dimension."""
    size = divide(tensor.size(-1), num_partitions)
    return list(torch.split(tensor, size, dim=-1))


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool,
                                         dim: int, stride: int) -> None:
    """Mark ``param`` as a TP shard split along ``dim`` (or as replicated)."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def set_defaults_if_not_set(param: torch.Tensor) -> None:
    """Replicated parameters (LayerNorm, row-parallel bias) get ``tensor_model_parallel=False``."""
    if not hasattr(param, "tensor_model_parallel"):
        set_tensor_model_parallel_attributes(param, False, -1, 1)


def set_sequence_parallel_attribute(param: torch.Tensor, enabled: bool) -> None:
    """Mark a replicated parameter that acts on this rank's ``s/p`` rows only (sequence
    parallelism: LayerNorms, the row-parallel biases): its gradient is a partial sum, which
    ``finalize_model_grads`` all-reduces over the TP group (Megatron's ``sequence_parallel``
    attribute)."""
    if enabled:
        param.sequence_parallel = True


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor,
                                           tp_group: ProcessGroup | None) -> bool:
    """True for TP shards, and for replicated parameters on TP rank 0 (count each once)."""
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank(tp_group) == 0


def split_master_weight(master: torch.Tensor, dim: int, num_partitions: int, rank: int,
                        stride: int = 1) -> torch.Tensor:
    """This rank's slice of a full weight, as Megatron's ``_initialize_affine_weight_cpu``.

    With ``stride`` s the dimension is cut in ``num_partitions * s`` blocks and rank r keeps
    blocks r, r + p, r + 2p, ... (for fused weights whose sub-matrices must each be split).
    """
    per_partition = divide(master.size(dim), num_partitions)
    per_stride = divide(per_partition, stride)
    blocks = torch.split(master, per_stride, dim=dim)
    return torch.cat(blocks[rank::num_partitions], dim=dim).contiguous()
