"""Model-parallel RNG: named random streams that can be forked into for a region of code.

Dropout inside the tensor-parallel region (attention probabilities, whose heads are split over TP
ranks) must differ between TP ranks, so it runs under ``get_rng_tracker().fork()``, a stream seeded
with ``seed + 2718 + tp_rank``. Dropout outside (embedding, residual: activations replicated on every
TP rank) uses the default generator, seeded identically on all TP ranks (Megatron-LM paper,
appendix B.2). The tracker swaps the generator of the compute device: the CPU generator on the CPU,
the current CUDA generator on a GPU.
"""

from __future__ import annotations

import contextlib

import torch

from megatron.core import device
from megatron.core.eager_regions import eager_region

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _get_device_rng_state() -> torch.Tensor:
    if device.accelerator_available():
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_device_rng_state(state: torch.Tensor) -> None:
    if device.accelerator_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed_device(seed: int) -> None:
    if device.accelerator_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    """Named RNG states of the compute device; ``fork(name)`` runs a block under one of them."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        self.states = {}
        self.seeds = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of the states, for checkpoints."""
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` (each name and seed used once)."""
        if seed in self.seeds:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        self.seeds.add(seed)
        saved = _get_device_rng_state()
        _manual_seed_device(seed)
        self.states[name] = _get_device_rng_state()
        _set_device_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block with stream ``name``; the default stream is restored afterwards."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} is not added (call model_parallel_manual_seed)")
        saved = _get_device_rng_state()
        _set_device_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_device_rng_state()
            _set_device_rng_state(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def run_in_tp_stream(function, *args, tp_size: int, **kwargs):
    """``function(*args, **kwargs)`` with draws that differ between the ``tp_size`` TP ranks:
    eagerly, under ``get_rng_tracker().fork()``.

    Inside a region that ``torch.compile`` traces (``--compile-layers``) a generator swap has no
    meaning: inductor draws the seeds of all of a graph's random ops from the default generator
    once, when the graph starts. With one TP rank there is no other rank's mask to differ from,
    so ``function`` is traced and draws from the default generator like the rest of the graph
    (reproducible: that generator is checkpointed and restored by recompute). With several
    ranks it runs eagerly under the fork, between two compiled graphs (a graph break)."""
    if not torch.compiler.is_compiling():
        with _TRACKER.fork():
            return function(*args, **kwargs)
    if tp_size == 1:
        return function(*args, **kwargs)
    return _forked_eagerly(function, *args, **kwargs)


@eager_region
def _forked_eagerly(function, *args, **kwargs):
    with _TRACKER.fork():
        return function(*args, **kwargs)


def model_parallel_manual_seed(seed: int, tensor_model_parallel_rank: int) -> None:
    """Seed the default device stream (same on all TP ranks) and the per-TP-rank stream.

    Megatron-LM's ``model_parallel_cuda_manual_seed``: the data-parallel (default) stream gets
    ``seed``; the model-parallel stream gets ``seed + 2718 + tp_rank``.
    """
    _manual_seed_device(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME,
                 seed + _MODEL_PARALLEL_SEED_OFFSET + tensor_model_parallel_rank)


# Activation checkpointing --------------------------------------------------------------------
def _get_all_rng_states() -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    cuda_state = _get_device_rng_state() if device.accelerator_available() else None
    return torch.get_rng_state(), cuda_state, _TRACKER.get_states()


def _set_all_rng_states(states) -> None:
    cpu_state, cuda_state, tracker_states = states
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        _set_device_rng_state(cuda_state)
    _TRACKER.set_states(tracker_states)


class _CheckpointFunction(torch.autograd.Function):
    """Run ``function`` without saving activations; rerun it in backward under the RNG states of
    the forward, so dropout masks are the same on recompute (Megatron's ``CheckpointFunction``)."""

    @staticmethod
    def forward(ctx, function, distribute_saved_activations, tp_group, *args):
        ctx.function = function
        ctx.distribute = distribute_saved_activations
        ctx.tp_group = tp_group
        ctx.rng_states = _get_all_rng_states()
        with torch.no_grad():
            outputs = function(*args)
        ctx.tensor_index = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        tensors = [args[i] for i in ctx.tensor_index]
        ctx.needs_grad = [t.requires_grad for t in tensors]
        if distribute_saved_activations and tensors:
            # Keep only this TP rank's 1/p of the first input (replicated on all TP ranks).
            ctx.first_shape = tensors[0].shape
            tensors[0] = _chunk_for_rank(tensors[0], tp_group)
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        tensors = list(ctx.saved_tensors)
        if ctx.distribute and tensors:
            tensors[0] = _gather_chunks(tensors[0], ctx.first_shape, ctx.tp_group)
        args = list(ctx.others)
        for i, t, needs_grad in zip(ctx.tensor_index, tensors, ctx.needs_grad):
            args[i] = t.detach().requires_grad_(needs_grad)
        saved = _get_all_rng_states()
        _set_all_rng_states(ctx.rng_states)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*args)
        finally:
            _set_all_rng_states(saved)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if torch.is_tensor(a) else None for a in args)
        return (None, None, None) + input_grads


def _chunk_for_rank(tensor: torch.Tensor, tp_group) -> torch.Tensor:
    from megatron.core.tensor_parallel.utils import divide, tp_rank, tp_world_size

    size = tp_world_size(tp_group)
    flat = tensor.detach().reshape(-1)
    per_rank = divide(flat.numel(), size)
    start = tp_rank(tp_group) * per_rank
    return flat[start:start + per_rank].clone()


def _gather_chunks(chunk: torch.Tensor, shape: torch.Size, tp_group) -> torch.Tensor:
    from megatron.core import comm
    from megatron.core.tensor_parallel.utils import tp_world_size

    full = torch.empty(chunk.numel() * tp_world_size(tp_group), dtype=chunk.dtype,
                       device=chunk.device)
    comm.all_gather_into(full, chunk, tp_group)
    return full.view(shape)


def checkpoint(function, distribute_saved_activations: bool, *args, tp_group=None):
    """Activation checkpointing that restores the RNG states (CPU, device and tracker) on
    recompute, so dropout draws the same masks twice.

    Args:
        function: the region to recompute; called as ``function(*args)``.
        distribute_saved_activations: keep only a 1/TP slice of the first tensor argument
            between forward and backward (it is all-gathered again for the recompute).
        *args: the region's inputs (tensors, or other values passed through unchanged).
        tp_group: the TP group used by ``distribute_saved_activations`` (None: this rank
            alone, no tensor parallelism).

    Returns:
        ``function(*args)``.
    """
    return _CheckpointFunction.apply(function, distribute_saved_activations, tp_group, *args)


# A region whose random draws use the TP stream inside a compiled layer: run eagerly, it must
# also be recomputed eagerly by the checkpoint above (the one that restores the tracker).
checkpoint_eagerly = eager_region(checkpoint)
