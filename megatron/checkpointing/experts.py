"""Routed experts over expert-parallel ranks in the ``--ckpt-format torch`` layout.

With ``--expert-model-parallel-size`` EP each ``mp_rank_TT[_PPP]_EEE`` shard holds the whole
dense model and its ``num_experts / EP`` local experts under local indices
(``...mlp.local_experts.{i}...``, global expert ``E * num_experts / EP + i``), as Megatron-LM's
legacy checkpoints number them. Merging the EP shards of one TP/PP position renumbers the
experts globally; splitting keeps the dense tensors on every rank and each rank's experts
renumbered locally. Pure functions of dicts of tensors: nothing here opens a file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TypeVar

from megatron.checkpointing.errors import CheckpointError

_EXPERT = re.compile(r"(?P<head>.*\.local_experts\.)(?P<index>\d+)(?P<tail>\..*)")
"""A routed expert's key (the shared experts and the router are dense)."""

T = TypeVar("T")


def expert_of(key: str) -> int | None:
    """The expert index in ``key`` (local or global, as the key holds it); None: dense."""
    match = _EXPERT.fullmatch(key)
    return None if match is None else int(match.group("index"))


def with_expert(key: str, index: int) -> str:
    """``key`` with its expert index replaced by ``index``."""
    match = _EXPERT.fullmatch(key)
    assert match is not None, key
    return f"{match.group('head')}{index}{match.group('tail')}"


def merge_expert_parallel(per_rank: Sequence[Mapping[str, T]], where: str = "") -> dict[str, T]:
    """One TP/PP position's flat dicts of the EP ranks (local experts) -> one dict with every
    expert under its global index; the dense entries are EP rank 0's (every rank holds the same).

    Raises:
        CheckpointError: the ranks hold different numbers of experts or different dense keys.
    """
    counts = [len({expert_of(k) for k in flat if expert_of(k) is not None}) for flat in per_rank]
    if len(set(counts)) != 1:
        raise CheckpointError(f"{where}: the expert-parallel shards hold {counts} local experts "
                              "(each holds the same number): a damaged or mixed-up checkpoint")
    dense = [{k for k in flat if expert_of(k) is None} for flat in per_rank]
    if any(keys != dense[0] for keys in dense[1:]):
        raise CheckpointError(f"{where}: the expert-parallel shards hold different dense "
                              "tensors: a damaged or mixed-up checkpoint")
    local = counts[0]
    position = {key: i for i, key in enumerate(per_rank[0])}
    block_start: dict[str, int] = {}  # the experts' ModuleList prefix -> its first key
    for key, i in position.items():
        match = _EXPERT.fullmatch(key)
        if match is not None:
            block_start.setdefault(match.group("head"), i)
    placed: list[tuple[tuple[int, int, int], str, T]] = []
    for rank, flat in enumerate(per_rank):
        for key, value in flat.items():
            match = _EXPERT.fullmatch(key)
            if match is None:
                if rank == 0:
                    placed.append(((position[key], 0, 0), key, value))
                continue
            index = rank * local + int(match.group("index"))
            # Module order: the experts' list where rank 0 holds it, by global index.
            order = (block_start[match.group("head")], index, position.get(key, 0))
            placed.append((order, with_expert(key, index), value))
    return {key: value for _, key, value in sorted(placed, key=lambda item: item[0])}


def split_expert_parallel(flat: Mapping[str, T], size: int, rank: int,
                          num_experts: int) -> dict[str, T]:
    """EP rank ``rank``'s part of a whole flat dict: the dense entries and its
    ``num_experts / size`` experts renumbered locally, in ``flat``'s order."""
    local = num_experts // size
    out: dict[str, T] = {}
    for key, value in flat.items():
        index = expert_of(key)
        if index is None:
            out[key] = value
        elif rank * local <= index < (rank + 1) * local:
            out[with_expert(key, index - rank * local)] = value
    return out


def dense_expert_rank(tp_rank: int, tp_size: int, expert_tp_size: int) -> int:
    """The EP rank whose ``mp_rank_TT_EEE`` directory of TP rank ``tp_rank`` holds the dense
    part of ``distrib_optim.pt`` (written by that TP rank's data-parallel rank 0).

    That writer is in-stage rank ``tp_rank`` (the dense grid's order ``tp-cp-dp``), EP rank
    ``tp_rank // ETP`` of the expert grid (``etp-ep-edp``, valid where ETP x EP >= TP): EP rank
    0 when the experts are split as the dense layers (ETP = TP), EP rank ``tp_rank`` when each
    expert is whole (ETP = 1)."""
    assert tp_rank < tp_size, (tp_rank, tp_size)
    return tp_rank // expert_tp_size


def expert_file_ranks(tp_size: int, expert_tp_rank: int, expert_tp_size: int,
                      ep_rank: int) -> tuple[int, int]:
    """(TP rank, EP rank) in the name of the ``mp_rank_TT[_PPP]_EEE`` file that holds the ETP
    slice ``expert_tp_rank`` of EP rank ``ep_rank``'s experts.

    The torch format's writers are the expert-data-parallel rank-0 ranks, in-stage ranks
    ``r = etp_rank + ETP * ep_rank < ETP x EP``; each names its file by its dense TP rank
    ``r mod TP`` and its EP rank (Megatron-LM's naming), and holds the dense TP slice
    ``r mod TP`` besides its experts' ETP slice ``r mod ETP``."""
    writer = expert_tp_rank + expert_tp_size * ep_rank
    return writer % tp_size, ep_rank


def torch_format_layout_error(tp_size: int, expert_tp_size: int, ep_size: int) -> str | None:
    """Why the torch format's files cannot hold this expert grid (None: they can): the
    writers' names repeat when ETP > TP, and the dense TP slices miss some when ETP x EP < TP.
    """
    if expert_tp_size > tp_size:
        return (f"expert tensor-parallel size {expert_tp_size} above the tensor-parallel size "
                f"{tp_size}: two writers would share an mp_rank file name")
    if expert_tp_size * ep_size < tp_size:
        return (f"expert tensor-parallel size {expert_tp_size} x expert-parallel size "
                f"{ep_size} below the tensor-parallel size {tp_size}: the files would not hold "
                "every TP slice of the dense layers")
    return None
