"""Model-parallel process groups: tensor (TP), pipeline (PP), data (DP), model and embedding groups.

Ranks are laid out as Megatron-LM does: TP is the fastest-varying dimension, then DP, then PP.
With 16 ranks, TP=2 and PP=4 (so DP=2)::

    tensor    [0,1] [2,3] ... [14,15]
    data      [0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]
    pipeline  [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]
    model     [0,1,4,5,8,9,12,13] [2,3,6,7,10,11,14,15]
    embedding [0,12] [1,13] [2,14] [3,15]   (first and last stage of each pipeline)

The rank lists come from one pure function, :func:`rank_layout`, which the process groups, the CLI
(``python -m megatron.core.parallel_state``) and the tests share. The live groups are held by one
:class:`ParallelState` object, the only global of the library, built by
:func:`initialize_model_parallel` and dropped by :func:`destroy_model_parallel`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import sys

import torch.distributed as dist

from megatron.core.expert_layout import ExpertRankLayout, expert_rank_layout

Groups = list[list[int]]


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """Every group of every kind, as lists of global ranks."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    pipeline_model_parallel_split_rank: int | None
    tensor: Groups
    pipeline: Groups
    data: Groups
    model: Groups
    embedding: Groups
    position_embedding: Groups
    context_parallel_size: int = 1
    context: Groups = dataclasses.field(default_factory=list)
    """Ranks splitting one sequence (empty at context-parallel size 1)."""
    data_with_context: Groups = dataclasses.field(default_factory=list)
    """DP x CP: the ranks gradients are reduced and optimizer state is sharded over (empty at
    context-parallel size 1, where it is ``data``)."""

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The ``kind`` group (``"tensor"``, ``"data"``...) that contains global ``rank``."""
        for ranks in getattr(self, kind):
            if rank in ranks:
                return ranks
        return []


def rank_layout(world_size: int, tensor_model_parallel_size: int = 1,
                pipeline_model_parallel_size: int = 1,
                virtual_pipeline_model_parallel_size: int | None = None,
                pipeline_model_parallel_split_rank: int | None = None,
                context_parallel_size: int = 1) -> RankLayout:
    """Compute all rank groups for a world, without creating any process group.

    Args:
        world_size: total number of ranks.
        tensor_model_parallel_size: ranks a layer is split over (fastest-varying).
        pipeline_model_parallel_size: number of pipeline stages.
        virtual_pipeline_model_parallel_size: model chunks per stage (interleaved schedule).
        pipeline_model_parallel_split_rank: stage where the decoder starts (encoder-decoder models);
            that stage joins the embedding groups.
        context_parallel_size: ranks each sequence is split over; placed between TP and DP in
            Megatron-Core's order (tp-cp-ep-dp-pp), see :func:`context_parallel_groups`.

    Raises:
        ValueError: the sizes do not fit the world, naming the flags to change.
    """
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if world_size < 1 or tp < 1 or pp < 1:
        raise ValueError(f"world size ({world_size}), --tensor-model-parallel-size ({tp}) and "
                         f"--pipeline-model-parallel-size ({pp}) must be positive")
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world size ({world_size}) is not divisible by --tensor-model-parallel-size ({tp}) x "
            f"--pipeline-model-parallel-size ({pp}) = {tp * pp}")
    cp = context_parallel_size
    if cp < 1 or world_size % (tp * pp * cp) != 0:
        raise ValueError(f"world size ({world_size}) is not divisible by "
                         f"--tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size "
                         f"({pp}) x --context-parallel-size ({cp}) = {tp * pp * cp}")
    if virtual_pipeline_model_parallel_size is not None:
        # Megatron-LM 23.06 asked for more than two stages; the interleaved schedule here
        # orders a pair's messages so that two stages work too (docs/compatibility.md).
        if pp < 2:
            raise ValueError("virtual pipeline stages (the interleaved schedule) need "
                             f"--pipeline-model-parallel-size >= 2, got {pp}")
        if virtual_pipeline_model_parallel_size < 1:
            raise ValueError("virtual pipeline size must be positive, got "
                             f"{virtual_pipeline_model_parallel_size}")
    split = pipeline_model_parallel_split_rank
    if split is not None and not 0 <= split < pp:
        raise ValueError(f"--pipeline-model-parallel-split-rank ({split}) must be in "
                         f"[0, --pipeline-model-parallel-size ({pp}))")
    dp = world_size // (tp * pp)
    ranks_per_stage = world_size // pp

    data: Groups = []
    for stage in range(pp):
        start = stage * ranks_per_stage
        for tp_rank in range(tp):
            data.append(list(range(start + tp_rank, start + ranks_per_stage, tp)))
    # A model-parallel group is one replica: every rank with the same DP index.
    model = [[group[dp_rank] for group in data] for dp_rank in range(dp)]
    tensor = [list(range(i * tp, (i + 1) * tp)) for i in range(world_size // tp)]
    pipeline = [list(range(i, world_size, ranks_per_stage)) for i in range(ranks_per_stage)]

    embedding: Groups = []
    position_embedding: Groups = []
    for ranks in pipeline:
        emb = [ranks[0], ranks[-1]] if len(ranks) > 1 else [ranks[0]]
        pos = [ranks[0]]
        if split is not None and len(ranks) > 1:
            if ranks[split] not in emb:
                emb = sorted(emb + [ranks[split]])
            if ranks[split] not in pos:
                pos = [ranks[0], ranks[split]]
        embedding.append(emb)
        position_embedding.append(pos)

    context: Groups = []
    data_with_context: Groups = []
    if cp > 1:
        dp //= cp
        data, model, context, data_with_context = context_parallel_groups(world_size, tp, cp, pp)
    return RankLayout(world_size, tp, pp, dp, virtual_pipeline_model_parallel_size, split,
                      tensor, pipeline, data, model, embedding, position_embedding,
                      cp, context, data_with_context)


def grid_groups(world_size: int, sizes: dict[str, int], varying: str) -> Groups:
    """Megatron-Core's ``RankGenerator``: ranks laid out over the dimensions of ``sizes``
    (the first varies fastest), one group per combination of the dimensions not in
    ``varying`` (``"dp-cp"``: the ranks that differ only in their DP and CP index), each group
    listed with its fastest dimension varying fastest, the groups by their first rank."""
    names = list(sizes)
    assert world_size == _product(sizes.values()), (world_size, sizes)
    strides = {name: _product(sizes[n] for n in names[:i]) for i, name in enumerate(names)}
    vary = [n for n in names if n in varying.split("-")]
    fixed = [n for n in names if n not in vary]

    def offsets(dims: list[str]) -> list[int]:
        # reversed: itertools.product varies its last factor fastest.
        return [sum(strides[n] * i for n, i in zip(reversed(dims), idx))
                for idx in itertools.product(*(range(sizes[n]) for n in reversed(dims)))]

    return sorted([base + off for off in offsets(vary)] for base in offsets(fixed))


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def context_parallel_groups(world_size: int, tp: int, cp: int,
                            pp: int) -> tuple[Groups, Groups, Groups, Groups]:
    """The groups context parallelism changes, in Megatron-Core's order tp-cp-dp-pp: (data,
    model, context, data x context). Data groups hold one CP index (the ranks reading different
    samples), model groups one DP and one CP index (TP x PP: one replica's sequence piece), and
    gradients are reduced over DP x CP (CP ranks hold the same weights, different tokens).
    Tensor and pipeline groups are those of CP = 1 (TP stays fastest, PP slowest)."""
    sizes = {"tp": tp, "cp": cp, "dp": world_size // (tp * cp * pp), "pp": pp}
    return (grid_groups(world_size, sizes, "dp"), grid_groups(world_size, sizes, "tp-pp"),
            grid_groups(world_size, sizes, "cp"), grid_groups(world_size, sizes, "cp-dp"))


@dataclasses.dataclass
class ParallelState:
    """This rank's process groups and positions, built by :func:`initialize_model_parallel`."""

    layout: RankLayout
    rank: int
    tensor_group: dist.ProcessGroup
    pipeline_group: dist.ProcessGroup
    data_group: dist.ProcessGroup
    model_group: dist.ProcessGroup
    embedding_group: dist.ProcessGroup | None
    position_embedding_group: dist.ProcessGroup | None
    virtual_pipeline_rank: int | None = None
    context_group: dist.ProcessGroup | None = None
    """None at context-parallel size 1 (this rank alone, for megatron.core.comm)."""
    data_with_context_group: dist.ProcessGroup | None = None
    """DP x CP; the data group itself at context-parallel size 1."""
    expert_layout: ExpertRankLayout | None = None
    """The expert layers' grid (parallel folding); None at expert-parallel size 1 with the
    experts split as the dense layers (ETP = TP), where the experts use the dense groups."""
    expert_groups: dict[str, dist.ProcessGroup] = dataclasses.field(default_factory=dict)
    """This rank's group of each :class:`ExpertRankLayout` field."""

    def ranks(self, kind: str) -> list[int]:
        return self.layout.group_of(kind, self.rank)


_STATE: ParallelState | None = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: int | None = None,
                              pipeline_model_parallel_split_rank: int | None = None,
                              distributed_timeout_minutes: float | None = None,
                              context_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1,
                              expert_tensor_parallel_size: int | None = None) -> None:
    """Create every process group of :func:`rank_layout` (collective: all ranks must call it),
    and with expert parallelism those of :func:`expert_rank_layout` (the dense grid unchanged).

    Args:
        tensor_model_parallel_size: see :func:`rank_layout`.
        pipeline_model_parallel_size: see :func:`rank_layout`.
        virtual_pipeline_model_parallel_size: see :func:`rank_layout`.
        pipeline_model_parallel_split_rank: see :func:`rank_layout`.
        distributed_timeout_minutes: how long a collective on any of the groups may wait
            (``--distributed-timeout-minutes``); None: the world group's timeout, as given to
            :func:`megatron.core.device.init_distributed`.
        context_parallel_size: see :func:`rank_layout`.
        expert_model_parallel_size: ranks the experts of an MoE layer are spread over (EP).
        expert_tensor_parallel_size: ranks each expert is split over (default: the TP size).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: the sizes do not fit the world.
    """
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("initialize torch.distributed (megatron.core.device.init_distributed) "
                           "before initialize_model_parallel")
    layout = rank_layout(dist.get_world_size(), tensor_model_parallel_size,
                         pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
                         pipeline_model_parallel_split_rank, context_parallel_size)
    rank = dist.get_rank()
    timeout = _group_timeout(distributed_timeout_minutes)

    def build(kind: str) -> dist.ProcessGroup | None:
        # new_group is collective over the whole world: every rank creates every group.
        mine = None
        for ranks in getattr(layout, kind):
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine = group
        return mine

    groups = {kind: build(kind) for kind in
              ("tensor", "pipeline", "data", "model", "embedding", "position_embedding")}
    _STATE = ParallelState(
        layout=layout, rank=rank,
        tensor_group=groups["tensor"], pipeline_group=groups["pipeline"],
        data_group=groups["data"], model_group=groups["model"],
        embedding_group=groups["embedding"],
        position_embedding_group=groups["position_embedding"],
        virtual_pipeline_rank=0 if virtual_pipeline_model_parallel_size is not None else None)
    _STATE.data_with_context_group = _STATE.data_group
    if layout.context_parallel_size > 1:
        _STATE.context_group = build("context")
        _STATE.data_with_context_group = build("data_with_context")
    etp = expert_tensor_parallel_size or tensor_model_parallel_size
    if expert_model_parallel_size > 1 or etp != tensor_model_parallel_size:
        _STATE.expert_layout = expert_rank_layout(
            dist.get_world_size(), etp, expert_model_parallel_size,
            pipeline_model_parallel_size)
        for field in dataclasses.fields(ExpertRankLayout):
            mine = None
            for ranks in getattr(_STATE.expert_layout, field.name):
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine = group
            _STATE.expert_groups[field.name] = mine


def _group_timeout(minutes: float | None) -> datetime.timedelta | None:
    """The timeout every group gets. new_group does not inherit the world group's: without
    one, a collective on a sub-group waits torch's default 30 minutes for a stuck peer."""
    from megatron.core import device

    if minutes is None:
        return device.collective_timeout()
    if minutes <= 0:
        raise ValueError(f"--distributed-timeout-minutes ({minutes}) must be positive")
    return datetime.timedelta(minutes=minutes)


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Drop the groups (the default world group stays)."""
    global _STATE
    if _STATE is not None:
        seen = set()
        for group in (_STATE.tensor_group, _STATE.pipeline_group, _STATE.data_group,
                      _STATE.model_group, _STATE.embedding_group,
                      _STATE.position_embedding_group, _STATE.context_group,
                      _STATE.data_with_context_group, *_STATE.expert_groups.values()):
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                try:
                    dist.destroy_process_group(group)
                except (ValueError, RuntimeError):
                    pass  # a group this rank is not part of
    _STATE = None


def get_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialized: call "
                           "initialize_model_parallel first")
    return _STATE


# Groups -------------------------------------------------------------------------------------
def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    return get_state().tensor_group


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    return get_state().pipeline_group


def get_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """The ranks reading different samples; ``with_context_parallel``: DP x CP, the ranks
    gradients are reduced and the distributed optimizer's state is sharded over."""
    state = get_state()
    return state.data_with_context_group if with_context_parallel else state.data_group


def get_model_parallel_group() -> dist.ProcessGroup:
    return get_state().model_group


def get_embedding_group() -> dist.ProcessGroup | None:
    return get_state().embedding_group


def get_position_embedding_group() -> dist.ProcessGroup | None:
    return get_state().position_embedding_group


# Expert parallelism (Megatron's parallel folding) -------------------------------------------
def has_expert_grid() -> bool:
    """Whether the experts run on their own grid (EP > 1 or ETP != TP): their gradients then
    have their own buffers over the expert-data-parallel group and their norm its own groups.
    False before initialization and where the experts use the dense groups."""
    return _STATE is not None and _STATE.expert_layout is not None


def _expert_group(field: str) -> dist.ProcessGroup | None:
    state = get_state()
    return state.expert_groups[field] if state.expert_layout is not None else None


def get_expert_model_parallel_group() -> dist.ProcessGroup | None:
    """The ranks an MoE layer's experts are spread over; None (this rank alone) without the
    expert grid."""
    return _expert_group("expert_model") if _STATE is not None else None


def get_expert_model_parallel_world_size() -> int:
    """EP (1 before initialization)."""
    if _STATE is None or _STATE.expert_layout is None:
        return 1
    return dist.get_world_size(_STATE.expert_groups["expert_model"])


def get_expert_model_parallel_rank() -> int:
    """This rank's index in its expert-parallel group (0 before initialization)."""
    if _STATE is None or _STATE.expert_layout is None:
        return 0
    return dist.get_rank(_STATE.expert_groups["expert_model"])


def get_expert_data_parallel_group() -> dist.ProcessGroup | None:
    """The ranks holding the same experts: expert gradients are reduced and their optimizer
    state sharded here. Without the expert grid the dense DP x CP group."""
    if get_state().expert_layout is None:
        return get_data_parallel_group(with_context_parallel=True)
    return _expert_group("expert_data")


def get_expert_tensor_parallel_group() -> dist.ProcessGroup | None:
    """The ranks each expert's weights are split over (ETP). Without the expert grid
    the dense TP group."""
    if get_state().expert_layout is None:
        return get_tensor_model_parallel_group()
    return _expert_group("expert_tensor")


def get_expert_tensor_parallel_rank() -> int:
    """This rank's index in its expert tensor-parallel group (the TP rank without the expert
    grid; 0 before initialization)."""
    if _STATE is None or _STATE.expert_layout is None:
        return get_tensor_model_parallel_rank()
    return dist.get_rank(_STATE.expert_groups["expert_tensor"])


def get_expert_tensor_and_model_parallel_group() -> dist.ProcessGroup | None:
    """ETP x EP: the ranks whose tokens one MoE layer's dispatcher exchanges. Without the expert
    grid the dense TP group."""
    if get_state().expert_layout is None:
        return get_tensor_model_parallel_group()
    return _expert_group("expert_tensor_and_model")


def get_expert_tensor_model_pipeline_parallel_group() -> dist.ProcessGroup | None:
    """ETP x EP x PP: the expert parameters' gradient norm is summed here. Without the
    expert grid the dense model-parallel group (TP x PP)."""
    if get_state().expert_layout is None:
        return get_model_parallel_group()
    return _expert_group("expert_tensor_model_pipeline")


# Sizes and ranks ----------------------------------------------------------------------------
# The TP/PP/DP size and rank getters answer (1, 0) before initialize_model_parallel, as for a
# single process: gpt_model_from (tools/generate.py, single-process model tests),
# checkpointing.get_checkpoint_name and get_megatron_optimizer rely on it. Every other getter
# raises, as Megatron-LM's do, because no sensible answer exists without the groups.
def _size_and_rank(kind: str, single_process_default: bool = False) -> tuple[int, int]:
    if _STATE is None:
        if single_process_default:
            return 1, 0
        get_state()  # raises, naming initialize_model_parallel
    ranks = _STATE.ranks(kind)
    if _STATE.rank not in ranks:
        members = {"embedding": "the first and last pipeline stages and the split stage",
                   "position_embedding": "the first pipeline stage and the split stage"}
        raise RuntimeError(f"rank {_STATE.rank} is in no {kind.replace('_', '-')} group (only "
                           f"{members.get(kind, 'some ranks')} are): check "
                           f"is_rank_in_{kind}_group() first")
    return len(ranks), ranks.index(_STATE.rank)


def get_tensor_model_parallel_world_size() -> int:
    """Number of ranks in this rank's tensor-model-parallel group (1 before initialization)."""
    return _size_and_rank("tensor", single_process_default=True)[0]


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-model-parallel group (0 before initialization)."""
    return _size_and_rank("tensor", single_process_default=True)[1]


def get_pipeline_model_parallel_world_size() -> int:
    """Number of ranks in this rank's pipeline-model-parallel group (1 before initialization)."""
    return _size_and_rank("pipeline", single_process_default=True)[0]


def get_pipeline_model_parallel_rank() -> int:
    """This rank's index in its pipeline-model-parallel group (0 before initialization)."""
    return _size_and_rank("pipeline", single_process_default=True)[1]


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Number of ranks in this rank's data-parallel group (1 before initialization);
    ``with_context_parallel``: of its DP x CP group."""
    return _size_and_rank(_data_kind(with_context_parallel), single_process_default=True)[0]


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """This rank's index in its data-parallel group (0 before initialization);
    ``with_context_parallel``: in its DP x CP group."""
    return _size_and_rank(_data_kind(with_context_parallel), single_process_default=True)[1]


def _data_kind(with_context_parallel: bool) -> str:
    cp = _STATE.layout.context_parallel_size if _STATE is not None else 1
    return "data_with_context" if with_context_parallel and cp > 1 else "data"


# Context parallelism ------------------------------------------------------------------------
def get_context_parallel_group() -> dist.ProcessGroup | None:
    """The ranks splitting this rank's sequences; None (this rank alone) at CP size 1."""
    return get_state().context_group if _STATE is not None else None


def get_context_parallel_world_size() -> int:
    """Ranks each sequence is split over (1 before initialization and at CP size 1)."""
    if _STATE is None or _STATE.layout.context_parallel_size == 1:
        return 1
    return _size_and_rank("context")[0]


def get_context_parallel_rank() -> int:
    """This rank's index in its context-parallel group (0 before initialization)."""
    if _STATE is None or _STATE.layout.context_parallel_size == 1:
        return 0
    return _size_and_rank("context")[1]


def get_context_parallel_global_ranks() -> list[int]:
    """Global ranks of this rank's context-parallel group, in CP-rank order."""
    state = get_state()
    return state.ranks("context") if state.layout.context_parallel_size > 1 else [state.rank]


def get_model_parallel_world_size() -> int:
    """Ranks in this rank's model-parallel group (TP x PP). Raises before initialization."""
    return _size_and_rank("model")[0]


def get_model_parallel_rank() -> int:
    """This rank's index in its model-parallel group. Raises before initialization."""
    return _size_and_rank("model")[1]


def get_embedding_group_world_size() -> int:
    """Ranks sharing this rank's tied word embedding (first and last stage, plus the split
    stage if any).

    Raises:
        RuntimeError: not initialized, or this rank holds no word embedding.
    """
    return _size_and_rank("embedding")[0]


def get_embedding_group_rank() -> int:
    """This rank's index in its embedding group (0 on the first pipeline stage).

    Raises:
        RuntimeError: not initialized, or this rank holds no word embedding.
    """
    return _size_and_rank("embedding")[1]


def get_position_embedding_group_world_size() -> int:
    """Ranks sharing this rank's position embedding (first stage, plus the split stage).

    Raises:
        RuntimeError: not initialized, or this rank holds no position embedding.
    """
    return _size_and_rank("position_embedding")[0]


def get_position_embedding_group_rank() -> int:
    """This rank's index in its position-embedding group.

    Raises:
        RuntimeError: not initialized, or this rank holds no position embedding.
    """
    return _size_and_rank("position_embedding")[1]


def get_embedding_group_ranks() -> list[int]:
    return get_state().ranks("embedding")


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    """True on ranks that hold a copy of the tied word embedding."""
    state = get_state()
    ranks = state.ranks("embedding")
    if state.rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if state.rank == ranks[0]:
        return is_pipeline_first_stage()
    if state.rank == ranks[-1]:
        return is_pipeline_last_stage()
    return True


def is_rank_in_position_embedding_group() -> bool:
    state = get_state()
    return state.rank in state.ranks("position_embedding")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's tensor group (broadcast source)."""
    return get_state().ranks("tensor")[0]


def get_data_parallel_src_rank() -> int:
    return get_state().ranks("data")[0]


def get_pipeline_model_parallel_first_rank() -> int:
    return get_state().ranks("pipeline")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return get_state().ranks("pipeline")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next pipeline stage (wraps around)."""
    ranks = get_state().ranks("pipeline")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous pipeline stage (wraps around)."""
    ranks = get_state().ranks("pipeline")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def get_pipeline_model_parallel_split_rank() -> int | None:
    return get_state().layout.pipeline_model_parallel_split_rank if _STATE else None


# Virtual pipeline ---------------------------------------------------------------------------
def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return get_state().layout.virtual_pipeline_model_parallel_size if _STATE else None


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return get_state().virtual_pipeline_rank if _STATE else None


def set_virtual_pipeline_model_parallel_rank(rank: int) -> None:
    """Select the model chunk the interleaved schedule is running."""
    get_state().virtual_pipeline_rank = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """True on the first stage (and, with virtual stages, the first model chunk)."""
    if not ignore_virtual and _STATE is not None and _STATE.virtual_pipeline_rank not in (None, 0):
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """True on the last stage (and, with virtual stages, the last model chunk)."""
    if not ignore_virtual and _STATE is not None and _STATE.virtual_pipeline_rank is not None:
        vpp = _STATE.layout.virtual_pipeline_model_parallel_size
        if _STATE.virtual_pipeline_rank != vpp - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_pipeline_stage_before_split(rank: int | None = None) -> bool:
    """True if the stage runs the encoder of an encoder-decoder model (always without a split)."""
    split = get_pipeline_model_parallel_split_rank()
    if split is None or get_pipeline_model_parallel_world_size() == 1:
        return True
    rank = get_pipeline_model_parallel_rank() if rank is None else rank
    return rank < split


def is_pipeline_stage_after_split(rank: int | None = None) -> bool:
    split = get_pipeline_model_parallel_split_rank()
    if split is None or get_pipeline_model_parallel_world_size() == 1:
        return True
    rank = get_pipeline_model_parallel_rank() if rank is None else rank
    return rank >= split


# CLI ----------------------------------------------------------------------------------------
def format_layout(layout: RankLayout) -> str:
    """Human-readable listing of every group kind."""

    def fmt(groups: Groups) -> str:
        return " ".join("[" + ",".join(map(str, g)) + "]" for g in groups)

    lines = [
        f"world size {layout.world_size}: tensor-model-parallel {layout.tensor_model_parallel_size}"
        f" x pipeline-model-parallel {layout.pipeline_model_parallel_size}"
        f" x data-parallel {layout.data_parallel_size}"
        + (f", virtual pipeline stages {layout.virtual_pipeline_model_parallel_size}"
           if layout.virtual_pipeline_model_parallel_size else "")
        + (f", pipeline split rank {layout.pipeline_model_parallel_split_rank}"
           if layout.pipeline_model_parallel_split_rank is not None else ""),
        f"tensor-model-parallel groups:   {fmt(layout.tensor)}",
        f"pipeline-model-parallel groups: {fmt(layout.pipeline)}",
        f"data-parallel groups:           {fmt(layout.data)}",
        f"model-parallel groups:          {fmt(layout.model)}",
        f"embedding groups:               {fmt(layout.embedding)}",
        f"position-embedding groups:      {fmt(layout.position_embedding)}",
    ]
    if layout.context_parallel_size > 1:
        lines[0] += f", context-parallel {layout.context_parallel_size}"
        lines += [f"context-parallel groups:        {fmt(layout.context)}",
                  f"data x context groups:          {fmt(layout.data_with_context)}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.core.parallel_state", allow_abbrev=False,
        description="Print how ranks are grouped, without launching anything.")
    parser.add_argument("--world-size", type=int, required=True, metavar="N",
                        help="Total number of ranks (torchrun's nnodes x nproc-per-node).")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="N",
                        help="Ranks each layer is split over; the fastest-varying dimension "
                             "(default: 1).")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="N",
                        help="Number of pipeline stages; the slowest-varying dimension "
                             "(default: 1). Data parallelism takes what is left.")
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                        metavar="N",
                        help="Model chunks per pipeline stage (interleaved schedule; needs "
                             "--pipeline-model-parallel-size >= 2). Training derives it from "
                             "--num-layers-per-virtual-pipeline-stage.")
    parser.add_argument("--context-parallel-size", type=int, default=1, metavar="N",
                        help="Ranks each sequence is split over; between TP and DP in "
                             "Megatron-Core's order tp-cp-dp-pp (default: 1).")
    parser.add_argument("--pipeline-model-parallel-split-rank", type=int, default=None,
                        metavar="R",
                        help="Pipeline stage where the decoder starts (encoder-decoder models); "
                             "it joins the embedding and position-embedding groups.")
    args = parser.parse_args(argv)
    try:
        layout = rank_layout(args.world_size, args.tensor_model_parallel_size,
                             args.pipeline_model_parallel_size,
                             args.virtual_pipeline_model_parallel_size,
                             args.pipeline_model_parallel_split_rank,
                             args.context_parallel_size)
    except ValueError as err:
        parser.error(str(err))
    sys.stdout.write(format_layout(layout) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
