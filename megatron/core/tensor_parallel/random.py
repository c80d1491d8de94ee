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


def model_parallel_manual_seed(seed: int, tensor_model_parallel_rank: int) -> None:
    """Seed the default device stream (same on all TP ranks) and the per-TP-rank stream.

    Megatron-LM's ``model_parallel_cuda_manual_seed``: the data-parallel (default) stream gets
    ``seed``; the model-parallel stream gets ``seed + 2718 + tp_rank``.
    """
    _manual_seed_device(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME,
                 seed + _MODEL_PARALLEL_SEED_OFFSET + tensor_model_parallel_rank)
