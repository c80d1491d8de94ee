"""``checkpoint_version`` and what changed with it: the row order of the fused QKV weight.

QKV rows by version (docs/FORMATS.md 2d; Megatron-LM's ``fix_query_key_value_ordering``), for ``np``
heads of ``hn`` rows each and ``num_splits`` = 3 (``query_key_value``) or 2 (``key_value``):

* 0 (or no version key): ``[num_splits, np, hn]`` — all q rows, then all k, then all v;
* 1.0: ``[np, hn, num_splits]``;
* >= 2.0 (3.0 is written): ``[np, num_splits, hn]`` — per head its q, k and v blocks, which is
  what the attention reads and why a contiguous TP split hands each rank whole heads.

Everything here takes plain integers: the heads of the tensor at hand (a TP shard holds
``num_attention_heads / tensor_model_parallel_size`` of them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from megatron.checkpointing.errors import CheckpointError

CHECKPOINT_VERSION = 3.0
"""The version this framework writes (Megatron-LM 23.06 and later write 3.0 too)."""

_QKV_SUFFIXES = {".query_key_value.weight": 3, ".query_key_value.bias": 3,
                 ".key_value.weight": 2, ".key_value.bias": 2}


def checkpoint_version(state_dict: Mapping) -> float | None:
    """The ``checkpoint_version`` of a loaded ``model_optim_rng.pt``; None when it has none
    (Megatron-LM then reads version 0)."""
    if "checkpoint_version" not in state_dict:
        return None
    return float(state_dict["checkpoint_version"])


def _check_version(version: float) -> None:
    if version < 2.0 and version not in (0.0, 1.0):
        raise CheckpointError(f"checkpoint_version {version}: only 0, 1.0 and >= 2.0 exist; the "
                              "QKV row order is unknown")


def _view_shape(t: torch.Tensor, num_splits: int, num_heads: int,
                version: float) -> tuple[int, ...]:
    head_dim, remainder = divmod(t.shape[0], num_splits * num_heads)
    if remainder or head_dim == 0:
        raise ValueError(f"{t.shape[0]} QKV rows are not a multiple of {num_splits} x "
                         f"{num_heads} heads")
    rest = tuple(t.shape[1:])
    if version == 0.0:
        return (num_splits, num_heads, head_dim, *rest)
    if version == 1.0:
        return (num_heads, head_dim, num_splits, *rest)
    return (num_heads, num_splits, head_dim, *rest)


def qkv_to_current_order(t: torch.Tensor, num_splits: int, num_heads: int,
                         version: float) -> torch.Tensor:
    """Fused QKV rows of a checkpoint of ``version`` -> the current ``[np, num_splits, hn]``
    order (for version >= 2.0, ``t``'s data as it is).

    Args:
        t: ``[num_splits * num_heads * hn, ...]`` weight or bias.
        num_splits: 3 for ``query_key_value``, 2 for ``key_value``.
        num_heads: the heads ``t`` holds (per TP shard: heads / TP size).
        version: the checkpoint's ``checkpoint_version`` (0 when it has none).

    Raises:
        ValueError: the rows are not a multiple of ``num_splits * num_heads``.
        CheckpointError: a version other than 0, 1.0 or >= 2.0.
    """
    _check_version(version)
    old = t.reshape(_view_shape(t, num_splits, num_heads, version))
    if version == 0.0:
        old = old.transpose(0, 1)  # [np, splits, hn, ...]
    elif version == 1.0:
        old = old.transpose(1, 2)  # [np, splits, hn, ...]
    return old.contiguous().view(t.shape)


def qkv_from_current_order(t: torch.Tensor, num_splits: int, num_heads: int,
                           version: float) -> torch.Tensor:
    """The inverse of :func:`qkv_to_current_order`: ``[np, num_splits, hn]`` rows -> the order
    of ``version`` (version 0's ``[num_splits, np, hn]`` is HuggingFace GPT-2's ``c_attn``
    row order, transposed)."""
    _check_version(version)
    current = t.reshape(_view_shape(t, num_splits, num_heads, 2.0))  # [np, splits, hn, ...]
    if version == 0.0:
        current = current.transpose(0, 1)  # [splits, np, hn, ...]
    elif version == 1.0:
        current = current.transpose(1, 2)  # [np, hn, splits, ...]
    return current.contiguous().view(t.shape)


def fix_query_key_value_ordering(state_dict: dict, version: float, num_attention_heads: int,
                                 tensor_model_parallel_size: int = 1,
                                 source: str = "the checkpoint") -> int:
    """Reorder, in place, every fused QKV tensor of one shard's ``model`` (or ``model0``,
    ``model1``... with virtual pipeline stages) from the order of ``version`` to the current one.

    Args:
        state_dict: a loaded ``model_optim_rng.pt`` (nested model dicts are walked).
        version: its ``checkpoint_version`` (0 when it has none).
        num_attention_heads: heads of the whole model.
        tensor_model_parallel_size: TP shards the heads are spread over.
        source: names the file in errors.

    Returns:
        The number of tensors converted (0 for version >= 2.0).

    Raises:
        CheckpointError: a version other than 0, 1.0 or >= 2.0; rows not a multiple of the
            heads per shard.
    """
    if version >= 2.0:
        return 0
    if version not in (0.0, 1.0):
        raise CheckpointError(f"{source} has checkpoint_version {version}: only 0, 1.0 and "
                              ">= 2.0 exist (this run writes 3.0); the QKV row order is unknown")
    heads = num_attention_heads // tensor_model_parallel_size
    converted = 0

    def walk(node: dict, prefix: str) -> None:
        nonlocal converted
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, path + ".")
                continue
            splits = next((n for suffix, n in _QKV_SUFFIXES.items() if path.endswith(suffix)),
                          None)
            if splits is None:
                continue
            if value.shape[0] % (splits * heads):
                raise CheckpointError(
                    f"{path} in {source} has {value.shape[0]} rows, not a multiple of "
                    f"{splits} x {heads} heads per TP rank: check --num-attention-heads "
                    "and --tensor-model-parallel-size")
            node[key] = qkv_to_current_order(value, splits, heads, version)
            converted += 1

    for key in [k for k in state_dict if k == "model" or re.fullmatch(r"model\d+", k)]:
        walk(state_dict[key], "")
    return converted
