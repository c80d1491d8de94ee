"""The distributed optimizer (``--use-distributed-optimizer``, ZeRO-1).

Each DP rank owns one chunk of every bucket of every grad buffer (the buffer is padded so the
chunks are equal; with one bucket, as without ``--overlap-grad-reduce``, this is one contiguous
shard of the buffer, exactly Megatron-LM 23.06). A parameter may straddle a chunk border; the part
of it inside this rank's chunk is a :class:`ShardPiece` with three ranges:

* world range: elements ``[world_start, world_end)`` of the grad buffer,
* param range: elements ``[param_start, param_end)`` of the flattened parameter,
* local range: ``world_start - shard_start`` within this rank's chunk.

Per piece the rank keeps an fp32 main param (a view of the model param when that is fp32, else an
fp32 copy) and the optimizer state, so params + grads + state cost ``p + g + (4 [+ 4] + 8) / d``
bytes per parameter. A step: the DDP wrapper has reduce-scattered the grads (this rank's chunk is
the DP average), main grads = the chunk's slices (an alias if fp32), unscale / inf check / norm
all-reduced over DP x MP, step, then the new params are all-gathered bucket by bucket *through the
grad buffer's memory* (no extra buffer, as Megatron-LM 23.06) and copied into every model param.
So after ``step()`` the grad buffers hold junk until ``zero_grad_buffer()``.

Checkpoints: ``state_dict()`` holds the param groups (+ grad scaler) only; the per-parameter state
goes through ``save_parameter_state`` / ``load_parameter_state`` = ``distrib_optim.pt``::

    {chunk_index: {grad_dtype: {"param": fp32[N], "exp_avg": fp32[N], "exp_avg_sq": fp32[N]}},
     "layout": {chunk_index: {grad_dtype: {"param_ranges": [(start, end), ...] (module order),
                                           "numel": N, "data_parallel_size": d}}}}

(``"momentum_buffer"`` instead of the Adam moments with SGD). ``N`` is the padded buffer size and
the tensors are the whole DP world's chunks gathered on DP rank 0 in buffer order. The extra
``"layout"`` lets a load at another DP size (or bucket layout) re-shard: each parameter is found by
its range. A 23.06 file has no layout; the parameters are then assumed back to back (its layout).

With expert parallelism the experts' buffers are sharded over the expert-data-parallel group,
and ``distrib_optim.pt`` is a list as Megatron-LM's ``ChainedOptimizer`` writes it: ``[dense,
expert]``, each a dict as above over the dense / the expert buffers, or None where this rank is
not rank 0 of that part's group (DP rank 0 holds the dense part, expert-DP rank 0 of each EP
rank its experts' part; the expert part's ``data_parallel_size`` is the expert-DP size).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from megatron.core import comm, device
from megatron.core.distributed.grad_buffer import Bucket, GradBuffer, compute_layout
from megatron.core.optimizer.optimizer import (MegatronOptimizer, copy_param_attributes,
                                               merged_param_group)


@dataclasses.dataclass
class ShardPiece:
    """The part of one model param inside this rank's chunk of a bucket."""

    model_param: torch.nn.Parameter
    buffer: GradBuffer
    bucket: Bucket
    world_start: int
    world_end: int
    param_start: int
    param_end: int
    main: torch.Tensor

    @property
    def local_start(self) -> int:
        """Offset of the piece in this rank's chunk of the bucket."""
        return self.world_start - self.bucket.offset - self.bucket.dp_rank * self.bucket.shard_numel


def build_shard_pieces(buffer: GradBuffer) -> list[ShardPiece]:
    """Intersect every param of ``buffer`` with this rank's chunk of its bucket."""
    pieces = []
    for bucket in buffer.buckets:
        shard_start = bucket.offset + bucket.dp_rank * bucket.shard_numel
        shard_end = shard_start + bucket.shard_numel
        for param in bucket.params:
            prange = buffer.param_index_map[param]
            start, end = max(prange.start, shard_start), min(prange.end, shard_end)
            if start >= end:
                continue
            flat = param.detach().view(-1)[start - prange.start:end - prange.start]
            # fp32 params are their own main params (a view: no copy, as in Megatron-LM).
            main = flat if param.dtype == torch.float32 else flat.clone().float()
            copy_param_attributes(param, main)
            pieces.append(ShardPiece(param, buffer, bucket, start, end, start - prange.start,
                                     end - prange.start, main))
    return pieces


class DistributedOptimizer(MegatronOptimizer):
    """Optimizer state and fp32 main params sharded over the data-parallel group.

    Args:
        param_groups: groups of model params (as for the other optimizers).
        optimizer_factory: builds the torch optimizer from groups of main params.
        model_chunks: the local-DDP-wrapped chunks (built with ``use_distributed_optimizer``).
        dp_group: the data-parallel group the state is sharded over.
        **kwargs: see :class:`MegatronOptimizer`.

    Raises:
        ValueError: a chunk is not a local DDP built for the distributed optimizer.
    """

    def __init__(self, param_groups: list[dict[str, Any]],
                 optimizer_factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                 model_chunks: list[torch.nn.Module],
                 dp_group: comm.ProcessGroup | None, **kwargs: Any) -> None:
        for chunk in model_chunks:
            if not getattr(chunk, "use_distributed_optimizer", False) or not hasattr(
                    chunk, "grad_buffers"):
                raise ValueError("--use-distributed-optimizer needs every model chunk wrapped in "
                                 "DistributedDataParallel(..., use_distributed_optimizer=True) "
                                 "(--DDP-impl local)")
        self.model_chunks = model_chunks
        self.dp_group = dp_group
        self.dp_rank = comm.rank(dp_group)
        self.pieces = [piece for chunk in model_chunks for buffer in chunk.all_grad_buffers()
                       for piece in build_shard_pieces(buffer)]
        group_of = {p: i for i, g in enumerate(param_groups) for p in g["params"]}
        main_groups = [{**g, "params": []} for g in param_groups]
        for piece in self.pieces:
            main_groups[group_of[piece.model_param]]["params"].append(piece.main)
        super().__init__(optimizer_factory(main_groups), **kwargs)
        self._num_steps = 0

    def reduction_groups(self) -> list[comm.ProcessGroup | None]:
        """Grads are sharded over DP too: norms and inf flags span the DP x MP world."""
        return [self.dp_group, self.mp_group]

    def expert_reduction_groups(self) -> list[comm.ProcessGroup | None]:
        """Expert grads are sharded over the expert-DP group: their norm spans it and the
        expert model-parallel group."""
        return [self.expert_dp_group, self.expert_mp_group]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for piece in self.pieces:
            piece.main.grad = None
            piece.model_param.grad = None

    def _copy_model_grads_to_main_grads(self) -> None:
        for piece in self.pieces:
            grad = piece.buffer.data[piece.world_start:piece.world_end]
            piece.main.grad = grad if grad.dtype == torch.float32 else grad.float()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Copy this rank's slice of every model param into its main param (fp32 model params
        are their own main params: their views need no copy)."""
        for piece in self.pieces:
            flat = piece.model_param.detach().view(-1)[piece.param_start:piece.param_end]
            if flat.data_ptr() != piece.main.data_ptr():
                piece.main.copy_(flat)

    def step(self):  # noqa: D102 - documented on the base class
        result = super().step()
        if result[0]:
            self._num_steps += 1
        return result

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        for piece in self.pieces:
            piece.main.grad = None  # the grad buffer is about to be overwritten
        by_bucket: dict[int, list[ShardPiece]] = {}
        for piece in self.pieces:
            by_bucket.setdefault(id(piece.bucket), []).append(piece)
        with self._timed("params-all-gather"):
            for chunk in self.model_chunks:
                for buffer in chunk.all_grad_buffers():
                    for bucket in buffer.buckets:
                        self._gather_bucket_params(buffer, bucket, by_bucket.get(id(bucket), []))

    def _gather_bucket_params(self, buffer: GradBuffer, bucket: Bucket,
                              pieces: list[ShardPiece]) -> None:
        """All-gather the updated params of one bucket through its own grad memory."""
        pbuf = _param_view(bucket)
        shard = slice(bucket.dp_rank * bucket.shard_numel,
                      (bucket.dp_rank + 1) * bucket.shard_numel)
        for piece in pieces:
            start = piece.world_start - bucket.offset
            pbuf[start:start + piece.main.numel()].copy_(piece.main)
        local = pbuf[shard].clone()  # the collective's input must not alias its output
        comm.all_gather_into(pbuf, local, bucket.dp_group)
        for param in bucket.params:
            prange = buffer.param_index_map[param]
            param.data.view(-1).copy_(pbuf[prange.start - bucket.offset:
                                           prange.end - bucket.offset])

    # Checkpointing ------------------------------------------------------------------------
    def _state_keys(self) -> tuple[str, ...]:
        if isinstance(self.optimizer, torch.optim.SGD):
            return ("momentum_buffer",)
        return ("exp_avg", "exp_avg_sq")

    def state_dict(self) -> dict[str, Any]:
        """Param groups (+ grad scaler); per-parameter state is in ``save_parameter_state``."""
        inner = self.optimizer.state_dict()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
        for group in groups:
            group["step"] = self._num_steps  # the per-param 'step' state is dropped with 'state'
        state = {"optimizer": {"param_groups": groups}}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore param groups and scaler; moments start at zero until ``load_parameter_state``.

        Raises:
            ValueError: the number of param groups differs.
        """
        inner = self.optimizer.state_dict()
        saved = state_dict["optimizer"]["param_groups"]
        if len(saved) != len(inner["param_groups"]):
            raise ValueError(f"the checkpoint has {len(saved)} optimizer param groups, this model "
                             f"{len(inner['param_groups'])}")
        # The saved 'step' is the optimizer's step count (below), not a group option.
        groups = [{k: v for k, v in merged_param_group(g, s, keep=("params",)).items()
                   if k != "step"} for s, g in zip(saved, inner["param_groups"])]
        self._num_steps = int(saved[0].get("step", 0)) if saved else 0
        state = {}
        if self._num_steps > 0:
            for group in groups:
                for index in group["params"]:
                    state[index] = {}
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        for piece in self.pieces:
            if self._num_steps > 0:
                self._piece_state(piece)
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def _piece_state(self, piece: ShardPiece) -> dict[str, torch.Tensor]:
        """The optimizer state of a piece, created (zeros, current step) when missing."""
        state = self.optimizer.state[piece.main]
        if "step" not in state and not isinstance(self.optimizer, torch.optim.SGD):
            # Where torch.optim keeps "step" itself: on the CPU unless fused/capturable.
            state["step"] = torch.tensor(float(self._num_steps), dtype=torch.float32,
                                         device=_step_device(self.optimizer, piece.main))
        for key in self._state_keys():
            if state.get(key) is None:
                state[key] = torch.zeros_like(piece.main)
        return state

    @property
    def has_expert_buffers(self) -> bool:
        """Expert parallelism: the experts' state is sharded over the expert-DP group."""
        return any(chunk.expert_grad_buffers for chunk in self.model_chunks)

    @torch.no_grad()
    def save_parameter_state(self, filename: str | os.PathLike | None = None
                             ) -> dict[Any, Any] | list[dict[Any, Any] | None] | None:
        """Gather main params and optimizer moments of the whole DP world (collective; with
        expert parallelism over the DP and the expert-DP groups).

        Args:
            filename: where this rank writes ``distrib_optim.pt`` when it holds a part of it;
                None to only return it.

        Returns:
            On DP rank 0 the ``distrib_optim.pt`` dict (module docstring); with expert
            parallelism the ``[dense, expert]`` list on a rank holding either part; else None.
        """
        dense = self._gather_state(lambda chunk: chunk.grad_buffers, self.dp_rank == 0)
        if not self.has_expert_buffers:
            state: Any = dense
        else:
            expert_root = comm.rank(self.expert_dp_group) == 0
            expert = self._gather_state(lambda chunk: chunk.expert_grad_buffers, expert_root)
            state = None if dense is None and expert is None else [dense, expert]
        if state is not None and filename is not None:
            torch.save(state, filename)
        return state

    def _gather_state(self, buffers_of: Callable[[Any], dict[torch.dtype, GradBuffer]],
                      is_root: bool) -> dict[Any, Any] | None:
        """The gathered state of the buffers ``buffers_of(chunk)`` of every chunk, on the
        rank 0 of their group (``is_root``); None elsewhere."""
        keys = ("param",) + self._state_keys()
        state: dict[Any, Any] = {}
        layout: dict[int, dict[torch.dtype, dict[str, Any]]] = {}
        for index, chunk in enumerate(self.model_chunks):
            state[index], layout[index] = {}, {}
            for dtype, buffer in buffers_of(chunk).items():
                full = {k: torch.zeros(buffer.numel, dtype=torch.float32, device="cpu")
                        for k in keys} if is_root else None
                for bucket in buffer.buckets:
                    self._gather_bucket_state(bucket, keys, full)
                state[index][dtype] = full
                layout[index][dtype] = {
                    "param_ranges": [(r.start, r.end) for r in buffer.param_ranges],
                    "numel": buffer.numel, "data_parallel_size": buffer.dp_size}
        if not is_root:
            return None
        state["layout"] = layout
        return state

    def _gather_bucket_state(self, bucket: Bucket, keys: tuple[str, ...],
                             full: dict[str, torch.Tensor] | None) -> None:
        size, dp = bucket.shard_numel, bucket.dp_size
        local = torch.zeros(len(keys), size, dtype=torch.float32,
                            device=device.get_device())  # [keys, shard]
        for piece in self.pieces:
            if piece.bucket is not bucket:
                continue
            span = slice(piece.local_start, piece.local_start + piece.main.numel())
            local[0, span] = piece.main
            state = self.optimizer.state.get(piece.main, {})
            for row, key in enumerate(keys[1:], start=1):
                if state.get(key) is not None:
                    local[row, span] = state[key]
        gathered = torch.empty(dp * len(keys) * size, dtype=torch.float32,
                               device=device.get_device())
        comm.all_gather_into(gathered, local.view(-1), bucket.dp_group)
        if full is not None:
            gathered = gathered.view(dp, len(keys), size)  # [dp rank, keys, shard]
            for row, key in enumerate(keys):
                full[key][bucket.offset:bucket.offset + dp * size] = gathered[:, row].reshape(-1)

    @torch.no_grad()
    def load_parameter_state(self, source: str | os.PathLike | dict[Any, Any] | list) -> None:
        """Load ``distrib_optim.pt`` (a path every rank can read, or the dict on every rank;
        with expert parallelism the ``[dense, expert]`` list, both parts present: the dense
        one from EP rank 0's file, the expert one from this EP rank's).

        Works at any DP size and bucket layout: each parameter is located by its saved range.

        Raises:
            ValueError: the file does not describe this model (chunks, grad dtypes, sizes).
        """
        state = source if isinstance(source, (dict, list)) else torch.load(
            source, map_location="cpu", weights_only=True, mmap=True)
        expert_parallel = self.has_expert_buffers
        if isinstance(state, list) != expert_parallel:
            raise ValueError(
                "the distributed optimizer checkpoint was saved "
                f"{'with' if isinstance(state, list) else 'without'} expert parallelism "
                f"(--expert-model-parallel-size > 1), this run "
                f"{'uses' if expert_parallel else 'does not use'} it: convert it with "
                "tools/checkpoint/convert.py --target-expert-parallel-size, or pass "
                "--no-load-optim")
        if not expert_parallel:
            self._load_state(state, lambda chunk: chunk.grad_buffers)
            return
        if len(state) != 2 or any(part is None for part in state):
            raise ValueError("the expert-parallel distributed optimizer checkpoint needs its "
                             "[dense, expert] parts (the dense one is in EP rank 0's "
                             "distrib_optim.pt)")
        self._load_state(state[0], lambda chunk: chunk.grad_buffers)
        self._load_state(state[1], lambda chunk: chunk.expert_grad_buffers)

    def _load_state(self, state: dict[Any, Any],
                    buffers_of: Callable[[Any], dict[torch.dtype, GradBuffer]]) -> None:
        layout = state.get("layout", {})
        for index, chunk in enumerate(self.model_chunks):
            for dtype, buffer in buffers_of(chunk).items():
                saved = state.get(index, {}).get(dtype)
                if saved is None:
                    raise ValueError(
                        f"distributed optimizer checkpoint has no state for model chunk {index}, "
                        f"grad dtype {dtype} (it has {sorted(map(str, state.get(index, {})))}); "
                        "was it saved with another --accumulate-allreduce-grads-in-fp32 / "
                        "precision or pipeline split?")
                ranges = _saved_ranges(layout.get(index, {}).get(dtype), buffer, saved, index)
                self._load_buffer_state(buffer, saved, ranges)

    def _load_buffer_state(self, buffer: GradBuffer, saved: dict[str, torch.Tensor],
                           ranges: list[tuple[int, int]]) -> None:
        missing = [k for k in self._state_keys() if k not in saved]
        if missing:
            raise ValueError(f"distributed optimizer checkpoint lacks {missing}: it was saved "
                             "with another --optimizer")
        position = {p: i for i, p in enumerate(buffer.params)}
        for piece in self.pieces:
            if piece.buffer is not buffer:
                continue
            start = ranges[position[piece.model_param]][0]
            src = slice(start + piece.param_start, start + piece.param_end)
            piece.main.copy_(saved["param"][src])
            state = self._piece_state(piece)
            for key in self._state_keys():
                state[key].copy_(saved[key][src])


def _step_device(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.device:
    """Where ``optimizer`` keeps a parameter's ``step`` (torch.optim's own rule): beside the
    parameter for the fused and capturable implementations, on the CPU otherwise."""
    defaults = optimizer.defaults
    on_param = defaults.get("fused") or defaults.get("capturable")
    return param.device if on_param else torch.device("cpu")


def _param_view(bucket: Bucket) -> torch.Tensor:
    """The bucket's grad memory seen as a buffer of its params' dtype (or its own dtype).

    Reinterpreting the bytes (fp32 grads hold 2x the bf16 params) keeps the all-gather at the
    param size; buckets mixing param dtypes gather in the (wider) grad dtype instead.
    """
    dtypes = {p.dtype for p in bucket.params}
    if len(dtypes) != 1:
        return bucket.data
    dtype = dtypes.pop()
    if dtype == bucket.data.dtype or dtype.itemsize > bucket.data.dtype.itemsize:
        return bucket.data
    raw = bucket.data.view(torch.uint8)
    return raw[:bucket.data.numel() * dtype.itemsize].view(dtype)


def _saved_ranges(layout: dict[str, Any] | None, buffer: GradBuffer,
                  saved: dict[str, torch.Tensor], index: int) -> list[tuple[int, int]]:
    """Per-parameter ranges of the saved buffer (computed as 23.06 lays it out if not stored)."""
    numels = [p.numel() for p in buffer.params]
    if layout is not None:
        ranges = [tuple(r) for r in layout["param_ranges"]]
    else:
        ranges = [(r.start, r.end) for r in compute_layout(numels, None, 1)[0]]
    sizes = [end - start for start, end in ranges]
    if sizes != numels or max(end for _, end in ranges) > saved["param"].numel():
        raise ValueError(
            f"distributed optimizer checkpoint for model chunk {index}, grad dtype {buffer.dtype} "
            f"holds {len(sizes)} params / {saved['param'].numel()} elements, this model "
            f"{len(numels)} params / {sum(numels)} elements: the model (or its TP/PP split) "
            "differs from the checkpoint's")
    return ranges  # type: ignore[return-value]
