"""Saver plug-in: a :class:`~tools.checkpoint.model_description.ModelDescription` -> a
Megatron-LM ``--ckpt-format torch`` checkpoint at any TP / PP / virtual-stage / expert-parallel
layout (with ``--target-expert-parallel-size`` EP > 1 every ``mp_rank_TT[_PPP]_EEE`` file holds
the dense model and its ``num_experts / EP`` experts, numbered locally).

Written one target pipeline stage at a time: the stage's layers are pulled from the loader
layer by layer, split over the target TP ranks (``megatron.checkpointing.layout``), and its
``mp_rank_TT_PPP/model_optim_rng.pt`` files written (atomically) before the next stage is
pulled; their sha256s go into the iteration directory's ``checksums.sha256`` at the end. ``args`` carry the new sizes, so ``--use-checkpoint-args`` and ``--load`` at the
new layout work. The optimizer state is written only when the loader carries it
(``--keep-optimizer-state``): each parameter's moments and fp32 main param split as the parameter
is, in the plain or the distributed optimizer's layout (``tools.checkpoint.optimizer_state``);
otherwise load the result with ``--no-load-optim`` or ``--finetune``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron.checkpointing import (CHECKPOINT_VERSION, DISTRIB_OPTIM_FILENAME, LAYOUTS,
                                    CheckpointError, PipelineStages, checkpoint_name,
                                    manifest_entry, nest_model_state, publish_tracker, save_file,
                                    tracker_path, write_manifest)
from megatron.checkpointing.experts import (dense_expert_rank, expert_of, split_expert_parallel,
                                            torch_format_layout_error)
from megatron.checkpointing.names import checkpoint_dir
from megatron.core.checkpoint_keys import HEAD_COPY_WEIGHT, layer_of, with_layer
from megatron.core.log import get_logger
from tools.checkpoint import optimizer_state
from tools.checkpoint.model_description import (OUTPUT_LAYER, VOCAB_ROWS, WORD_EMBEDDINGS,
                                                ModelDescription, padded_vocab_size,
                                                repad_vocab, swiglu_for_shards)


@dataclass(frozen=True)
class TargetLayout:
    """The layout to write."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    vocab_size_divisible_by: int | None = None
    """``--target-vocab-size-divisible-by``; None: the source's ``make_vocab_size_divisible_by``."""
    use_distributed_optimizer: bool | None = None
    """Write the optimizer state in the distributed optimizer's layout; None: as the source."""
    expert_parallel_size: int = 1
    """``--target-expert-parallel-size``: the routed experts split over this many ranks."""
    expert_tensor_parallel_size: int | None = None
    """``--target-expert-tensor-parallel-size``: each routed expert split over this many
    ranks (at most the target TP size, and with the target EP at least it: the torch format's
    files); None: the target TP size."""

    @property
    def etp(self) -> int:
        """The expert tensor-parallel size written."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_parallel_size if etp is None else etp

    def writers(self) -> list[tuple[int, int, int]]:
        """(TP rank, EP rank, expert TP rank) of each file of a stage, as training writes
        them: its ranks of expert-data-parallel rank 0, in-stage ranks r < ETP x EP, each
        file named by TP rank r % TP and EP rank r // ETP, holding that TP slice of the dense
        layers and its EP rank's experts' ETP slice r % ETP (every (TP, EP) pair at ETP =
        TP)."""
        tp, etp = self.tensor_parallel_size, self.etp
        return [(r % tp, r // etp, r % etp) for r in range(etp * self.expert_parallel_size)]

    def written_ranks(self) -> list[tuple[int, int]]:
        """The (TP rank, EP rank) of each file of a stage (see :meth:`writers`)."""
        return [(t, e) for t, e, _ in self.writers()]


def target_vocab_size(md: ModelDescription, target: TargetLayout) -> int:
    """The padded vocabulary of the written checkpoint: the source's when it still splits over
    the target TP size and no other multiple is asked for; else Megatron's padding of the true
    vocabulary (or, when that is unknown, of the source's padded size) to the new multiple."""
    divisible_by = target.vocab_size_divisible_by
    source = md.padded_vocab_size
    if divisible_by is None:
        if source % target.tensor_parallel_size == 0 and not md.repad:
            return source
        divisible_by = int(getattr(md.args, "make_vocab_size_divisible_by", 128))
    base = md.true_vocab_size if md.true_vocab_size is not None else source
    return padded_vocab_size(base, divisible_by, target.tensor_parallel_size)


def _virtual_size(num_layers: int, target: TargetLayout) -> int | None:
    per_stage = target.num_layers_per_virtual_pipeline_stage
    if per_stage is None:
        return None
    if num_layers % (target.pipeline_parallel_size * per_stage):
        raise ValueError(f"--target-num-layers-per-virtual-pipeline-stage {per_stage}: "
                         f"{num_layers} layers do not split into {target.pipeline_parallel_size} "
                         f"stages of chunks of {per_stage} layers")
    return num_layers // target.pipeline_parallel_size // per_stage


def target_args(md: ModelDescription, target: TargetLayout, vocab: int):
    """The source's args with the new parallel sizes and padded vocabulary."""
    args = md.args_copy()
    data_parallel = int(getattr(args, "data_parallel_size", 1) or 1)
    args.tensor_model_parallel_size = target.tensor_parallel_size
    args.pipeline_model_parallel_size = target.pipeline_parallel_size
    args.expert_model_parallel_size = target.expert_parallel_size
    if getattr(args, "num_experts", None) or \
            getattr(args, "expert_tensor_parallel_size", None) is not None:
        args.expert_tensor_parallel_size = target.etp
    args.num_layers_per_virtual_pipeline_stage = target.num_layers_per_virtual_pipeline_stage
    args.virtual_pipeline_model_parallel_size = _virtual_size(md.num_layers, target)
    args.world_size = target.tensor_parallel_size * target.pipeline_parallel_size * data_parallel
    args.padded_vocab_size = vocab
    if md.true_vocab_size is not None:  # kept through every conversion (exports drop padding)
        args.true_vocab_size = md.true_vocab_size
    args.make_vocab_size_divisible_by = _divisible_by(md, target, vocab)
    if hasattr(args, "model_parallel_size"):  # checkpoint_version < 3's name of the TP size
        del args.model_parallel_size
    if target.use_distributed_optimizer is not None:
        # The loading run's --use-distributed-optimizer is checked against it.
        args.use_distributed_optimizer = target.use_distributed_optimizer
    return args


def _divisible_by(md: ModelDescription, target: TargetLayout, vocab: int) -> int:
    """``make_vocab_size_divisible_by`` for the new args: the one asked for; else, when the
    source's padding multiple (its divisor x its TP) splits over the target TP, the divisor
    giving that same multiple at the target TP (128 at TP 1 -> 64 at TP 2: the run at the new
    layout passing that flag pads to the checkpoint's size); else the source's."""
    if target.vocab_size_divisible_by is not None:
        return target.vocab_size_divisible_by
    divisor = int(getattr(md.args, "make_vocab_size_divisible_by", 128))
    source_tp = int(getattr(md.args, "tensor_model_parallel_size", 1) or 1)
    multiple = divisor * source_tp
    if not md.repad and vocab == md.padded_vocab_size and \
            multiple % target.tensor_parallel_size == 0:
        return multiple // target.tensor_parallel_size
    return divisor


def _local(key: str, first_layer: int) -> str:
    """Global layer number -> the chunk's own numbering."""
    layer = layer_of(key)
    return key if layer is None else with_layer(key, layer - first_layer)


def _repadded(piece: dict[str, torch.Tensor], vocab: int) -> dict[str, torch.Tensor]:
    return {k: repad_vocab(v, vocab) if k in VOCAB_ROWS else v for k, v in piece.items()}


def _optimizer_piece(md: ModelDescription, piece: str, layer: int | None = None):
    """A piece's optimizer state (``{state key: {key: tensor}}``), or None when not carried."""
    return None if md.optimizer is None else md.optimizer_state(piece, layer)


def _chunk_pieces(md: ModelDescription, chunk, vocab: int):
    """One target model chunk's whole (not TP-split) tensors, piece by piece (the embedding,
    each layer, the head), layers numbered locally: (weights, optimizer state or None)."""
    def local(piece: dict) -> dict:
        return {_local(k, chunk.first_layer): v for k, v in piece.items()}

    if chunk.pre_process:
        state = _optimizer_piece(md, "embeddings")
        yield _repadded(md.embeddings(), vocab), _each(state, _repadded, vocab)
    for layer in range(chunk.first_layer, chunk.first_layer + chunk.num_layers):
        state = _optimizer_piece(md, "layer", layer)
        yield local(md.layer(layer)), _each(state, lambda s, _: local(s), None)
    if chunk.post_process:
        head = _repadded(md.head(), vocab)
        state = _each(_optimizer_piece(md, "head"), _repadded, vocab)
        if not chunk.pre_process and OUTPUT_LAYER not in head:
            # Tied output layer on another stage: the last stage keeps its own copy, trained
            # with the same (all-reduced) gradients: its optimizer state is the embedding's.
            head[HEAD_COPY_WEIGHT] = repad_vocab(md.embeddings()[WORD_EMBEDDINGS], vocab)
            if state is not None:
                for name, tensors in _optimizer_piece(md, "embeddings").items():
                    state[name][HEAD_COPY_WEIGHT] = repad_vocab(tensors[WORD_EMBEDDINGS], vocab)
        yield head, state


def _each(state, fn, arg):
    """``fn`` applied to every state key's dict of an optimizer piece (None stays None)."""
    return None if state is None else {name: fn(tensors, arg) for name, tensors in state.items()}


@dataclass
class _Shards:
    """One chunk's flat tensors split for the target: ``dense`` per TP rank (with the experts
    where they are split as the dense layers), else ``experts`` per expert TP rank; each with
    its optimizer state (``{state key: flat}``, empty when not carried); ``order``: every key's
    position in the model."""

    dense: list[dict[str, torch.Tensor]]
    dense_states: list[dict[str, dict[str, torch.Tensor]]]
    experts: list[dict[str, torch.Tensor]]
    expert_states: list[dict[str, dict[str, torch.Tensor]]]
    order: dict[str, int]


def _chunk_shards(md: ModelDescription, chunk, vocab: int, layout, tp: int,
                  etp: int | None = None) -> _Shards:
    """The chunk's flat weights and optimizer state split piece by piece (besides the output
    being built, only one piece is held whole): the dense layers over ``tp`` ranks, the routed
    experts over ``etp`` (default ``tp``: with the dense layers)."""
    apart = etp is not None and etp != tp
    out = _Shards([{} for _ in range(tp)], [{} for _ in range(tp)],
                  [{} for _ in range(etp)] if apart else [],
                  [{} for _ in range(etp)] if apart else [], {})
    swiglu = getattr(md.args, "swiglu", False)

    def split(tensors: dict, ranks: int) -> list[dict]:
        if swiglu:  # the whole [gate; up] -> each rank's [gate_r; up_r] after the split
            tensors = swiglu_for_shards(tensors, ranks)
        return layout.split_tensor_parallel(tensors, ranks)

    def place(tensors: dict, dense_out: list, expert_out: list, name: str | None) -> None:
        experts = {k: v for k, v in tensors.items() if apart and expert_of(k) is not None}
        dense = {k: v for k, v in tensors.items() if k not in experts}
        for parts, target in ((split(dense, tp), dense_out),
                              (split(experts, etp) if experts else [], expert_out)):
            for shard, part in zip(target, parts):
                (shard if name is None else shard.setdefault(name, {})).update(part)

    for piece, state in _chunk_pieces(md, chunk, vocab):
        for key in piece:
            out.order.setdefault(key, len(out.order))
        place(piece, out.dense, out.experts, None)
        for name, tensors in (state or {}).items():
            place(tensors, out.dense_states, out.expert_states, name)
        del piece, state
    return out


def save(md: ModelDescription, save_dir: str | Path, target: TargetLayout) -> Path:
    """Write ``md`` under ``save_dir`` at ``target``; returns the iteration directory.

    Raises:
        ValueError: the layers or heads do not split over the target sizes.
    """
    save_dir = Path(save_dir)
    layout = LAYOUTS[md.family]
    vocab = target_vocab_size(md, target)
    args = target_args(md, target, vocab)
    heads = int(md.args.num_attention_heads)
    experts = int(getattr(md.args, "num_experts", None) or 0)
    if target.expert_parallel_size > 1 and (not experts or experts % target.expert_parallel_size):
        raise ValueError(f"--target-expert-parallel-size {target.expert_parallel_size} does not "
                         f"divide the checkpoint's {experts or 'no'} routed experts "
                         "(--num-experts)")
    expert_ffn = getattr(md.args, "moe_ffn_hidden_size", None) or \
        getattr(md.args, "ffn_hidden_size", None)
    _check_expert_tensor_split(target, experts, int(expert_ffn) if expert_ffn else None)
    if heads % target.tensor_parallel_size:
        raise ValueError(f"--target-tensor-parallel-size {target.tensor_parallel_size} does not "
                         f"divide the {heads} attention heads")
    try:
        stages = PipelineStages(md.num_layers, target.pipeline_parallel_size,
                                args.virtual_pipeline_model_parallel_size)
    except ValueError as err:
        raise ValueError(f"--target-pipeline-parallel-size: {err}") from None
    plan = stages.chunks()
    digests: dict[str, str] = {}
    for stage in range(target.pipeline_parallel_size):
        # One stage's shards at a time: a function, so that nothing of the stage written
        # before stays referenced while the next one is built.
        digests.update(_save_stage(md, save_dir, target, layout, args, vocab,
                                   [c for c in plan if c.pipeline_rank == stage]))
    iteration_dir = checkpoint_dir(save_dir, md.iteration, md.release)
    write_manifest(iteration_dir, digests, flag="--save-dir")
    _publish(save_dir, md, iteration_dir)
    _say_how_to_load(save_dir, args, vocab)
    return iteration_dir


MEGATRON_DEFAULT_DIVISOR = 128
"""``--make-vocab-size-divisible-by``'s default."""


def _say_how_to_load(save_dir: Path, args, vocab: int) -> None:
    """The written embedding has ``vocab`` rows; a run padding the tokenizer's vocabulary with
    the default divisor at the new TP size may reach another size (50304 at TP 1 stays 50304
    at TP 2, where 128 x 2 pads GPT-2 to 50432): name the flag that loads it."""
    divisor, tp = int(args.make_vocab_size_divisible_by), int(args.tensor_model_parallel_size)
    if divisor == MEGATRON_DEFAULT_DIVISOR:
        return
    get_logger(__name__).warning(
        "%s: the embedding has %d rows (a multiple of --make-vocab-size-divisible-by %d x "
        "--tensor-model-parallel-size %d); load it with --use-checkpoint-args, or pass "
        "--make-vocab-size-divisible-by %d: the default %d can pad the tokenizer's vocabulary "
        "to another size", save_dir, vocab, divisor, tp, divisor, MEGATRON_DEFAULT_DIVISOR)


def _check_expert_tensor_split(target: TargetLayout, experts: int,
                               expert_ffn: int | None = None) -> None:
    """A target expert tensor-parallel size the torch format holds (see
    :func:`megatron.checkpointing.experts.torch_format_layout_error`) and the experts split
    over.

    Raises:
        ValueError: naming the flags.
    """
    tp, ep, etp = target.tensor_parallel_size, target.expert_parallel_size, target.etp
    if etp == tp:
        return
    flag = f"--target-expert-tensor-parallel-size {etp}"
    if not experts:
        raise ValueError(f"{flag}: the checkpoint has no routed experts (--num-experts)")
    if etp < 1:
        raise ValueError(f"{flag}: must be positive")
    why = torch_format_layout_error(tp, etp, ep)
    if why is not None:
        raise ValueError(f"{flag} with --target-tensor-parallel-size {tp} and "
                         f"--target-expert-parallel-size {ep}: {why} (this saver writes the "
                         "torch format: ETP <= TP <= ETP x EP)")
    if expert_ffn is not None and expert_ffn % etp:
        raise ValueError(f"{flag} does not divide the experts' --moe-ffn-hidden-size "
                         f"({expert_ffn})")


def _save_stage(md: ModelDescription, save_dir: Path, target: TargetLayout, layout, args,
                vocab: int, chunks) -> dict[str, str]:
    """Build and write every file of one target pipeline stage; returns their sha256s by
    manifest entry."""
    digests: dict[str, str] = {}
    tp, etp = target.tensor_parallel_size, target.etp
    weights: list[list[dict]] = [[] for _ in range(tp)]  # [tp][chunk] -> flat
    states: list[list[dict]] = [[] for _ in range(tp)]
    # Where the experts are split otherwise than the dense layers: [etp][chunk] -> flat.
    expert_weights: list[list[dict]] = [[] for _ in range(etp)]
    expert_states: list[list[dict]] = [[] for _ in range(etp)]
    orders: list[dict[str, int]] = []
    for chunk in chunks:
        shards = _chunk_shards(md, chunk, vocab, layout, tp, etp)
        for rank in range(tp):
            weights[rank].append(shards.dense[rank])
            states[rank].append(shards.dense_states[rank])
        for rank in range(etp if shards.experts else 0):
            expert_weights[rank].append(shards.experts[rank])
            expert_states[rank].append(shards.expert_states[rank])
        orders.append(shards.order)
        del shards
    ep = target.expert_parallel_size
    experts = int(getattr(md.args, "num_experts", None) or 0)
    for tp_rank, ep_rank, etp_rank in target.writers():
        flats, chunk_states = weights[tp_rank], states[tp_rank]
        if expert_weights[0]:  # TP rank tp_rank's dense slice, the experts' ETP slice
            flats = [_joined(d, x, order) for d, x, order in
                     zip(flats, expert_weights[etp_rank], orders)]
            chunk_states = [{name: _joined(d[name], x.get(name, {}), order) for name in d}
                            for d, x, order in zip(chunk_states, expert_states[etp_rank],
                                                   orders)]
        # EP rank ep_rank's experts (local indices) beside the dense tensors.
        own = [split_expert_parallel(flat, ep, ep_rank, experts) for flat in flats]
        own_states = [{name: split_expert_parallel(tensors, ep, ep_rank, experts)
                       for name, tensors in state.items()} for state in chunk_states]
        shard = _top_level(md, args)
        for chunk, flat in zip(chunks, own):
            shard[chunk.model_key] = nest_model_state(flat, layout.nested_sections)
        name = checkpoint_name(save_dir, md.iteration, md.release, tensor_rank=tp_rank,
                               pipeline_rank=chunks[0].pipeline_rank,
                               pipeline_parallel=target.pipeline_parallel_size > 1,
                               expert_rank=ep_rank, expert_parallel=ep > 1)
        if md.optimizer is not None:
            with_dense = ep_rank == dense_expert_rank(tp_rank, tp, etp)
            digests.update(_add_optimizer(shard, md, args, target, own, own_states, name,
                                          with_dense))
        digests[manifest_entry(name)] = save_file(shard, name, flag="--save-dir")
        del shard, own, own_states
    return digests


def _joined(dense: dict, experts: dict, order: dict[str, int]) -> dict:
    """One file's flat dict: the dense tensors and the experts' slice, in model order."""
    both = {**dense, **experts}
    return {k: both[k] for k in sorted(both, key=order.__getitem__)}


def _add_optimizer(shard: dict, md: ModelDescription, args, target: TargetLayout,
                   weights: list[dict], states: list[dict], name: Path,
                   with_dense: bool = True) -> dict[str, str]:
    """The shard's optimizer entries (and, distributed, its ``distrib_optim.pt``: returns its
    sha256 by manifest entry; with expert parallelism its dense part only ``with_dense``, in
    the file of the TP rank's data-parallel rank 0)."""
    kind = optimizer_state.target_of(md.optimizer, args, target.use_distributed_optimizer)
    digests = {}
    if kind.distributed:
        shard["optimizer"], distrib = optimizer_state.write_distributed(
            md.optimizer, kind, weights, states,
            expert_parallel=target.expert_parallel_size > 1, with_dense=with_dense)
        path = name.with_name(DISTRIB_OPTIM_FILENAME)
        digests[manifest_entry(path)] = save_file(distrib, path, flag="--save-dir")
    else:
        shard["optimizer"] = optimizer_state.write_plain(md.optimizer, weights, states)
    if md.optimizer.scheduler is not None:
        shard["opt_param_scheduler"] = md.optimizer.scheduler
    return digests


def _top_level(md: ModelDescription, args) -> dict:
    sd = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": md.iteration}
    sd.update(md.extra)
    return sd


def _publish(save_dir: Path, md: ModelDescription, iteration_dir: Path) -> None:
    if not md.release:
        publish_tracker(save_dir, md.iteration, iteration_dir, flag="--save-dir")
        return
    tracker = tracker_path(save_dir)
    tmp = tracker.with_name(f".{tracker.name}.tmp-{os.getpid()}")
    tmp.write_text("release")
    os.replace(tmp, tracker)


def refuse_existing(save_dir: Path) -> None:
    """A conversion never writes into a directory that already holds a checkpoint."""
    if tracker_path(save_dir).exists():
        raise CheckpointError(f"--save-dir {save_dir} already holds a checkpoint "
                              f"({tracker_path(save_dir).name}); choose an empty directory")
