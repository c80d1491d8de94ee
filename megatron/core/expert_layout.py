"""The expert layers' rank grid (Megatron-Core's "parallel folding"): a second grid over the
same ranks for the MoE layers, tp = expert tensor-parallel size (ETP), ep = expert-parallel
size (EP), dp = expert data-parallel size (world / (ETP x EP x PP)), pp = the dense grid's
pipeline size, in Megatron's ``RankGenerator`` order ``tp-cp-ep-dp-pp`` (cp = 1 for experts),
so the pipeline groups are the dense grid's.

Pure functions of the sizes (no process group), kept apart from ``parallel_state`` so that the
dense grid's module stays as it is.
"""

from __future__ import annotations

import dataclasses

Groups = list[list[int]]


def orthogonal_rank_groups(sizes: list[int], mask: list[bool]) -> Groups:
    """Megatron's ``generate_masked_orthogonal_rank_groups``: the ranks of a grid whose
    dimensions ``sizes`` vary fastest first (rank = sum idx[i] * prod(sizes[:i])), grouped over
    the dimensions where ``mask`` is True: one group per combination of the other dimensions'
    indices (enumerated fastest first), its ranks in the masked dimensions' order."""
    strides = [1]
    for size in sizes:
        strides.append(strides[-1] * size)
    masked = [(s, d) for s, d, m in zip(sizes, strides, mask) if m]
    unmasked = [(s, d) for s, d, m in zip(sizes, strides, mask) if not m]

    def offsets(dims: list[tuple[int, int]]) -> list[int]:
        out = [0]
        for size, stride in dims:
            out = [o + i * stride for i in range(size) for o in out]
        return out

    return [[base + o for o in offsets(masked)] for base in offsets(unmasked)]


@dataclasses.dataclass(frozen=True)
class ExpertRankLayout:
    """Every expert group of a world, as lists of global ranks."""

    expert_tensor: Groups
    expert_model: Groups
    """The expert-parallel groups (tokens travel within one)."""
    expert_tensor_and_model: Groups
    expert_data: Groups
    """Expert parameters' gradients are averaged (and their optimizer state sharded) here."""
    pipeline: Groups
    expert_tensor_model_pipeline: Groups
    """ETP x EP x PP: the expert parameters' model-parallel group (their gradient norm and
    inf flag are reduced over it, as the dense parameters' over TP x PP)."""


def expert_rank_layout(world_size: int, expert_tensor_parallel_size: int = 1,
                       expert_model_parallel_size: int = 1,
                       pipeline_model_parallel_size: int = 1) -> ExpertRankLayout:
    """The expert grid of ``world_size`` ranks.

    Raises:
        ValueError: ETP x EP x PP does not divide the world, naming the flags.
    """
    etp, ep, pp = (expert_tensor_parallel_size, expert_model_parallel_size,
                   pipeline_model_parallel_size)
    if world_size % (etp * ep * pp) != 0:
        raise ValueError(f"world size ({world_size}) is not divisible by "
                         f"--expert-tensor-parallel-size ({etp}) x "
                         f"--expert-model-parallel-size ({ep}) x "
                         f"--pipeline-model-parallel-size ({pp})")
    sizes = [etp, ep, world_size // (etp * ep * pp), pp]  # tp, ep, dp, pp (cp = 1)
    return ExpertRankLayout(
        expert_tensor=orthogonal_rank_groups(sizes, [True, False, False, False]),
        expert_model=orthogonal_rank_groups(sizes, [False, True, False, False]),
        expert_tensor_and_model=orthogonal_rank_groups(sizes, [True, True, False, False]),
        expert_data=orthogonal_rank_groups(sizes, [False, False, True, False]),
        pipeline=orthogonal_rank_groups(sizes, [False, False, False, True]),
        expert_tensor_model_pipeline=orthogonal_rank_groups(sizes, [True, True, False, True]))
