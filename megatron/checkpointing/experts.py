"""Routed experts over expert-parallel ranks in the ``--ckpt-format torch`` layout.

With ``--expert-model-parallel-size`` EP each ``mp_rank_TT[_PPP]_EEE`` shard holds the whole
dense model and its ``num_experts / EP`` local experts under local indices
(``...mlp.local_experts.{i}...``, global expert ``E * num_experts / EP + i``), as Megatron-LM's
legacy checkpoints number them. Merging the EP shards of one TP/PP position renumbers the
experts globally; splitting keeps the dense tensors on every rank and each rank's experts
renumbered locally. Where a rank's experts and its dense TP slice are in two files (the expert
grid's writers, see :func:`expert_file_ranks`), :func:`with_dense_part` combines them. Pure
functions of dicts of tensors: nothing here opens a file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

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


_RNG_KEYS = ("rng_state", "random_rng_state", "np_rng_state", "torch_rng_state",
             "cuda_rng_state", "rng_tracker_states")
"""Megatron-LM's ``rng_state`` list and the top-level keys of older checkpoints."""


def with_dense_part(expert_sd: dict, dense_sd: dict, param_is_expert: Sequence[bool] | None,
                    main_is_expert: Sequence[Sequence[bool]] | None = None) -> dict:
    """One rank's ``model_optim_rng.pt`` from two files where its experts and its dense TP
    slice are in different ones (TP not dividing ETP x EP): ``expert_sd``'s routed experts,
    everything else of ``dense_sd`` that is per TP rank: the dense model tensors (``model``,
    ``model0``...), the RNG states (the model-parallel tracker's are per TP rank) and, given
    ``param_is_expert`` (the optimizer's parameters in param-group order), the non-distributed
    optimizer's per-parameter state (with ``main_is_expert`` per fp32 main-parameter group,
    the fp16/bf16 optimizer's main copies). The distributed optimizer's state dict holds no
    per-parameter state (``distrib_optim.pt`` does): it is ``dense_sd``'s."""
    out = dict(expert_sd)
    for key, chunk in expert_sd.items():
        if key == "model" or (key.startswith("model") and key[5:].isdigit()):
            out[key] = _merge_by_expert(dense_sd[key], chunk)
    for key in _RNG_KEYS:
        if key in dense_sd:
            out[key] = dense_sd[key]
    if param_is_expert is not None and "optimizer" in expert_sd and "optimizer" in dense_sd:
        out["optimizer"] = _merge_optimizer_state(dense_sd["optimizer"],
                                                  expert_sd["optimizer"], param_is_expert,
                                                  main_is_expert)
    return out


def _merge_by_expert(dense: dict, expert: dict, prefix: str = "") -> dict:
    """A (nested) model state dict: the routed experts' leaves of ``expert``, the others of
    ``dense``, in ``expert``'s order."""
    out = {}
    for key, value in expert.items():
        if isinstance(value, dict):
            out[key] = _merge_by_expert(dense.get(key, {}), value, f"{prefix}{key}.")
        else:
            out[key] = value if expert_of(f"{prefix}{key}") is not None else dense[key]
    return out


def _merge_optimizer_state(dense: dict[str, Any], expert: dict[str, Any],
                           param_is_expert: Sequence[bool],
                           main_is_expert: Sequence[Sequence[bool]] | None) -> dict[str, Any]:
    """A torch (or Megatron fp16/bf16: ``{"optimizer": torch's, "fp32_from_fp16_params"}``)
    optimizer state dict: the experts' per-parameter state of ``expert``, the rest of
    ``dense`` (torch numbers the parameters in param-group order, the same on every rank of
    one stage)."""
    wrapped = "state" not in dense
    inner_d, inner_e = (dense.get("optimizer"), expert.get("optimizer")) if wrapped else \
        (dense, expert)
    if not isinstance(inner_d, dict) or "state" not in inner_d or "state" not in inner_e:
        return dense  # the distributed optimizer's: its state is in distrib_optim.pt
    state = {}
    for index in sorted({*inner_d["state"], *inner_e["state"]}, key=int):
        source = inner_e if param_is_expert[int(index)] else inner_d
        if index in source["state"]:
            state[index] = source["state"][index]
    merged = {**inner_d, "state": state}
    if not wrapped:
        return merged
    out = {**dense, "optimizer": merged}
    if main_is_expert is not None and "fp32_from_fp16_params" in dense:
        out["fp32_from_fp16_params"] = [
            [e if flag else d for flag, d, e in zip(flags, dg, eg)]
            for flags, dg, eg in zip(main_is_expert, dense["fp32_from_fp16_params"],
                                     expert["fp32_from_fp16_params"])]
    return out
