"""The distributed optimizer's state in Megatron's reshardable ``torch_dist`` form: per model
parameter, ``optimizer.state.<name>.<Megatron-Core key>`` for ``name`` in ``exp_avg``,
``exp_avg_sq`` (SGD: ``momentum_buffer``) and ``fp32_param`` (the main params), with the
parameter's own global shape and chunks (Megatron-Core's ``fully_sharded_model_space``). A
checkpoint so saved resumes at any TP / PP / DP layout. The param groups (with the step count)
and the grad scaler go to the common state under ``optimizer``.

Each data-parallel rank holds flat ranges of some parameters; to write rectangular chunks the
ranges of one parameter are summed over the data-parallel group into a whole (TP-local) tensor
(the ranges are disjoint), and a load copies each rank's ranges back out of the whole tensor.
This costs one parameter-sized fp32 buffer per state while it runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from megatron.checkpointing.dist.keys import HEAD_COPY_KEY, Chunk, match, tensor_chunks
from megatron.checkpointing.dist.model import Layout, _unwrap, key_rules
from megatron.checkpointing.errors import CheckpointError
from megatron.core import comm

PREFIX = "optimizer.state."
MAIN = "fp32_param"


def is_supported(optimizer) -> bool:
    """The optimizers whose state this module stores (the distributed optimizer)."""
    return hasattr(optimizer, "pieces") and hasattr(optimizer, "_piece_state")


def _named_params(model: Sequence[torch.nn.Module]) -> Iterator[tuple[int, str, torch.Tensor]]:
    for index, chunk in enumerate(model):
        for name, param in _unwrap(chunk).named_parameters():
            yield index, name, param


def _state_names(optimizer) -> tuple[str, ...]:
    return (MAIN,) + tuple(optimizer._state_keys())


def _pieces_of(optimizer) -> dict[int, list]:
    out: dict[int, list] = {}
    for piece in optimizer.pieces:
        out.setdefault(id(piece.model_param), []).append(piece)
    return out


def _piece_tensor(optimizer, piece, name: str) -> torch.Tensor:
    return piece.main if name == MAIN else optimizer._piece_state(piece)[name]


def state_tensors(model: Sequence[torch.nn.Module], optimizer, layout: Layout, swiglu: bool,
                  dp_group, for_save: bool, expert_dp_group=None
                  ) -> tuple[dict[str, list[Chunk]], list]:
    """``({optimizer key: chunks}, whole tensors)``: for a save filled from this DP group's
    ranges (collective over ``dp_group``; with expert parallelism the experts' over
    ``expert_dp_group``, which their state is sharded over); for a load zeros, to read into and
    then hand to :func:`scatter_back`.

    Raises:
        CheckpointError: the optimizer is not the distributed optimizer (a caller's error:
            :mod:`.plain_optimizer` stores the others).
    """
    if not is_supported(optimizer):
        raise CheckpointError("this is the distributed optimizer's torch_dist state; the other "
                              "optimizers' is megatron.checkpointing.dist.plain_optimizer's")
    rules = key_rules(model, swiglu)
    pieces = _pieces_of(optimizer)
    names = _state_names(optimizer)
    out: dict[str, list[Chunk]] = {}
    wholes = []
    for index, name, param in _named_params(model):
        if for_save and name == HEAD_COPY_KEY:
            continue
        found = match(rules, name)
        if found is None:
            raise CheckpointError(f"the torch_dist key table has no Megatron-Core name for {name}")
        rule, m = found
        placement, _ = layout.placement(index)
        for state in names:
            whole = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
            if for_save:
                flat = whole.view(-1)
                for piece in pieces.get(id(param), ()):
                    flat[piece.param_start:piece.param_end] = _piece_tensor(optimizer, piece,
                                                                            state)
                expert = expert_dp_group is not None and not getattr(param, "allreduce", True)
                comm.all_reduce(whole, expert_dp_group if expert else dp_group)
            wholes.append((param, state, whole))
            for chunk in tensor_chunks(rule, m, whole, placement):
                out.setdefault(PREFIX + state + "." + rule.mcore, []).append(chunk)
    return _first_per_offset(out), wholes


def _first_per_offset(tensors: dict[str, list[Chunk]]) -> dict[str, list[Chunk]]:
    out = {}
    for key, chunks in tensors.items():
        seen: dict[tuple[int, ...], Chunk] = {}
        for c in chunks:
            seen.setdefault(c.offset, c)
        out[key] = list(seen.values())
    return out


@torch.no_grad()
def scatter_back(optimizer, wholes: list) -> None:
    """After a load: this rank's ranges of every whole tensor into the optimizer."""
    pieces = _pieces_of(optimizer)
    by_param: dict[tuple[int, str], torch.Tensor] = {}
    for param, state, whole in wholes:
        by_param.setdefault((id(param), state), whole)
    for piece in optimizer.pieces:
        for state in _state_names(optimizer):
            whole = by_param.get((id(piece.model_param), state))
            if whole is not None:
                _piece_tensor(optimizer, piece, state).copy_(
                    whole.view(-1)[piece.param_start:piece.param_end])
    del pieces
