"""A model's tensors as ``torch_dist`` chunks at this rank's TP / PP / virtual-stage position.

Every model chunk's flat ``state_dict()`` tensors share storage with its parameters, so the
chunks built here are views: a save reads the weights without copying them, a load writes into
them in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron.core import comm
from megatron.checkpointing.dist import storage
from megatron.checkpointing.dist.keys import (BERT_OUTPUT_EXTRA_STATE, DECODER, ENCODER,
                                              HEAD_COPY_KEY, Chunk, KeyRule, Placement,
                                              bert_rules, extra_state_keys, gpt_rules,
                                              model_chunks)
from megatron.checkpointing.errors import CheckpointError
from megatron.core.models.builder import pipeline_stage_layers


@dataclass(frozen=True)
class Layout:
    """This rank's position in the model-parallel grid."""

    num_layers: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    vpp_size: int | None = None
    num_experts: int = 0
    """The MoE layers' routed experts (0: a dense model), split over TP as the dense MLP's."""
    ep_rank: int = 0
    ep_size: int = 1
    """Expert parallelism: this rank holds experts ``[ep_rank * E/EP, (ep_rank + 1) * E/EP)``
    of the global ``[layers, experts, ...]`` tensors."""
    etp_rank: int | None = None
    etp_size: int | None = None
    """The expert tensor-parallel split of each expert's weights (parallel folding: any ETP);
    None: the dense TP split."""

    @classmethod
    def from_parallel_state(cls, num_layers: int, num_experts: int | None = None) -> Layout:
        from megatron.core import parallel_state as ps
        etp_size = comm.world_size(ps.get_expert_tensor_parallel_group()) if num_experts \
            else None
        return cls(num_layers, ps.get_tensor_model_parallel_rank(),
                   ps.get_tensor_model_parallel_world_size(),
                   ps.get_pipeline_model_parallel_rank(),
                   ps.get_pipeline_model_parallel_world_size(),
                   ps.get_virtual_pipeline_model_parallel_world_size(), num_experts or 0,
                   ps.get_expert_model_parallel_rank(),
                   ps.get_expert_model_parallel_world_size(),
                   ps.get_expert_tensor_parallel_rank() if num_experts else None, etp_size)

    def placement(self, chunk_index: int) -> tuple[Placement, int]:
        """(placement of model chunk ``chunk_index``, its number of layers)."""
        local, offset = pipeline_stage_layers(self.num_layers, self.pp_size, self.pp_rank,
                                              self.vpp_size,
                                              chunk_index if self.vpp_size else None)
        local_experts = self.num_experts // self.ep_size
        return Placement(self.num_layers, offset, self.tp_rank, self.tp_size,
                         self.num_experts, self.ep_rank * local_experts, local_experts,
                         self.etp_rank, self.etp_size), local


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def _is_bert(model: Sequence[torch.nn.Module]) -> bool:
    from megatron.core.models.bert import BertBody
    return any(isinstance(_unwrap(chunk), BertBody) for chunk in model)


def key_rules(model: Sequence[torch.nn.Module], swiglu: bool) -> tuple[KeyRule, ...]:
    """The key table of ``model``'s family: BERT's (layers under ``encoder.``, its heads) for
    BERT models (every stage, the heads' or not), else GPT's."""
    return bert_rules(swiglu) if _is_bert(model) else gpt_rules(swiglu)


def model_tensors(model: Sequence[torch.nn.Module], layout: Layout, swiglu: bool,
                  for_save: bool) -> dict[str, list[Chunk]]:
    """``{Megatron-Core key: this rank's chunks}`` of every model chunk in ``model``.

    ``for_save``: leave out the last stage's copy of the tied embedding (a replica of stage 0's,
    which Megatron-Core does not store); a load reads it from stage 0's key.
    """
    rules = key_rules(model, swiglu)
    out: dict[str, list[Chunk]] = {}
    for index, chunk in enumerate(model):
        state = _unwrap(chunk).state_dict()
        if for_save:
            state.pop(HEAD_COPY_KEY, None)
        placement, _ = layout.placement(index)
        for key, chunks in model_chunks(state, rules, placement).items():
            out.setdefault(key, []).extend(chunks)
    return _dedup(out)


def _dedup(tensors: dict[str, list[Chunk]]) -> dict[str, list[Chunk]]:
    """One chunk per offset: a single-stage model with tied embeddings has no copy, but a
    load of the head copy and the embedding on one rank would ask for one offset twice."""
    out = {}
    for key, chunks in tensors.items():
        seen: dict[tuple[int, ...], Chunk] = {}
        for c in chunks:
            seen.setdefault(c.offset, c)
        out[key] = list(seen.values())
    return out


def duplicate_chunks(model: Sequence[torch.nn.Module], layout: Layout, swiglu: bool
                     ) -> list[tuple[Chunk, Chunk]]:
    """Chunks a load must copy after reading (a rank holding one offset twice: the tied head
    copy on a stage that also holds the embedding, which only virtual stages make)."""
    rules = key_rules(model, swiglu)
    pairs = []
    first: dict[tuple[str, tuple[int, ...]], Chunk] = {}
    for index, chunk in enumerate(model):
        placement, _ = layout.placement(index)
        for key, chunks in model_chunks(_unwrap(chunk).state_dict(), rules, placement).items():
            for c in chunks:
                kept = first.setdefault((key, c.offset), c)
                if kept is not c:
                    pairs.append((kept, c))
    return pairs


def model_objects(model: Sequence[torch.nn.Module], layout: Layout) -> dict[str, None]:
    """Megatron-Core's ``_extra_state`` objects of this rank's layers (all ``None`` here)."""
    out: dict[str, None] = {}
    bert = _is_bert(model)
    for index, chunk in enumerate(model):
        placement, local = layout.placement(index)
        names = _unwrap(chunk).state_dict().keys()
        out.update(dict.fromkeys(extra_state_keys(placement, local, names,
                                                  ENCODER if bert else DECODER)))
        if bert and "lm_head.bias" in names:
            out[BERT_OUTPUT_EXTRA_STATE] = None
    return out


def load_weights(model: Sequence[torch.nn.Module], directory, layout: Layout, swiglu: bool,
                 strictness: str = "assume_ok_unexpected", verify_checksums: bool = True,
                 log=None) -> storage.Mismatch:
    """Read the weights of ``model`` (this rank's chunks) from a ``torch_dist`` directory, in
    place; collective over the world.

    ``strictness`` is Megatron-Core's ``StrictHandling`` (:data:`storage.STRICTNESS`): with
    ``assume_ok_unexpected`` / ``raise_*`` a weight the checkpoint lacks is an error; ``log_*``,
    ``return_*`` and ``ignore_all`` leave it as it is (logged with ``log_*``); tensors of the
    checkpoint the model does not ask for are an error only with ``raise_all``.

    Returns:
        The key mismatch (for ``return_*``).

    Raises:
        CheckpointError: missing or unexpected keys (per ``strictness``), other global shapes,
            a missing, truncated or corrupt file (named).
    """
    directory = Path(directory)
    metadata = storage.read_metadata(directory)
    storage.check_files(directory, metadata, verify_checksums)
    tensors = model_tensors(model, layout, swiglu, for_save=False)
    mismatch = storage.compare(metadata, tensors, (), directory)
    mismatch.missing = [k for k in mismatch.missing if "/shard_" not in k]  # objects: not ours
    check_strictness(mismatch, strictness, directory, log)
    wanted = {k: v for k, v in tensors.items() if k not in set(mismatch.unexpected)}
    storage.load(directory, wanted, (), metadata)
    with torch.no_grad():
        for kept, copy in duplicate_chunks(model, layout, swiglu):
            copy.data.copy_(kept.data)
    return mismatch


def check_strictness(mismatch: storage.Mismatch, strictness: str, directory, log=None) -> None:
    """Apply Megatron-Core's strictness to ``mismatch`` (see :func:`load_weights`).

    Raises:
        CheckpointError: a mismatch the mode refuses.
    """
    if strictness not in storage.STRICTNESS:
        raise ValueError(f"--dist-ckpt-strictness {strictness!r}: expected one of "
                         f"{', '.join(storage.STRICTNESS)}")
    unexpected, missing = mismatch.unexpected, mismatch.missing
    if unexpected and strictness in ("assume_ok_unexpected", "raise_unexpected", "raise_all"):
        raise CheckpointError(
            f"the torch_dist checkpoint {directory} lacks tensors this model needs: "
            f"{', '.join(unexpected)} (another model, or saved with other flags; "
            "--dist-ckpt-strictness log_unexpected loads the rest)")
    if missing and strictness == "raise_all":
        raise CheckpointError(
            f"the torch_dist checkpoint {directory} holds tensors this model does not load "
            f"(--dist-ckpt-strictness raise_all): {', '.join(missing)}")
    if log is not None and strictness.startswith("log_") and unexpected:
        log(f"torch_dist checkpoint {directory}: not in the checkpoint, left as they are: "
            f"{', '.join(unexpected)}")
    if log is not None and strictness == "log_all" and missing:
        log(f"torch_dist checkpoint {directory}: in the checkpoint, not loaded: "
            f"{', '.join(missing)}")


def save_weights(model: Sequence[torch.nn.Module], directory, layout: Layout, swiglu: bool,
                 common: dict | None = None, fully_parallel: bool = True) -> None:
    """Write ``model``'s weights (and ``common`` as the common state) as a bare ``torch_dist``
    directory, as ``dist_checkpointing.save(model.sharded_state_dict(), dir)`` does; collective
    over the world."""
    import torch.distributed as dist
    directory = Path(directory)
    objects: dict = {storage.COMMON_STATE_KEY: common or {}}
    objects.update(model_objects(model, layout))
    digests = storage.save(directory, model_tensors(model, layout, swiglu, for_save=True),
                           objects, fully_parallel)
    every = comm.all_gather_object(digests, comm.world_group())
    if dist.get_rank() == 0:
        storage.finish(directory, {k: v for d in every for k, v in d.items()})
    comm.barrier(comm.world_group())
