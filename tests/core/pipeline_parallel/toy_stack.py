"""A stack of Linear + tanh layers split into pipeline chunks, for the schedule tests.

Virtual stage ``c * p + r`` (chunk ``c`` of pipeline rank ``r``) holds layers
``[(c * p + r) * n, (c * p + r + 1) * n)`` of the whole stack, as Megatron's interleaved layer
offset does; the last virtual stage adds a mean-squared-error loss against a target. Every rank
builds the whole stack from one seed and keeps its layers, so a one-process run of the whole
stack is the reference.
"""

from __future__ import annotations

import functools
import types

import torch

SEQ, BATCH, HIDDEN = 3, 2, 8


class Chunk(torch.nn.Module):
    """Some consecutive layers; the first virtual stage reads the data, later ones the input
    set by the schedule. ``config`` tells the schedules the hidden size of what stages send."""

    config = types.SimpleNamespace(hidden_size=HIDDEN)

    def __init__(self, layers: list[torch.nn.Linear], virtual_stage: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.virtual_stage = virtual_stage
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        self.input_tensor = input_tensor

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        hidden = data if self.virtual_stage == 0 else self.input_tensor  # [s, b, h]
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        return hidden


def whole_stack(num_layers: int, seed: int = 1234,
                dtype: torch.dtype = torch.float32) -> list[torch.nn.Linear]:
    torch.manual_seed(seed)
    return [torch.nn.Linear(HIDDEN, HIDDEN, dtype=dtype) for _ in range(num_layers)]


def chunks_of_rank(layers: list[torch.nn.Linear], pp_size: int, pp_rank: int,
                   num_chunks: int) -> list[Chunk]:
    per_stage = len(layers) // (pp_size * num_chunks)
    chunks = []
    for c in range(num_chunks):
        stage = c * pp_size + pp_rank
        chunks.append(Chunk(layers[stage * per_stage:(stage + 1) * per_stage], stage))
    return chunks


def micro_batches(count: int, seed: int = 99,
                  dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(SEQ, BATCH, HIDDEN, generator=generator, dtype=dtype),
             torch.randn(SEQ, BATCH, HIDDEN, generator=generator, dtype=dtype))
            for _ in range(count)]


def _loss_func(target: torch.Tensor, output: torch.Tensor):
    loss = ((output - target) ** 2).mean()
    return loss, {"loss": loss.detach().clone()}


def forward_step(data_iterator, model: Chunk):
    """Megatron's ``forward_step`` contract: every chunk reads the micro-batch (the first uses
    the input, the last the target)."""
    data, target = next(data_iterator)
    return model(data), functools.partial(_loss_func, target)
