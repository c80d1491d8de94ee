"""The routed experts of one MoE layer: ``local_experts``, one MLP per expert this rank holds
(Megatron-LM's legacy ``SwitchMLP`` names, ``local_experts.<i>.dense_h_to_4h`` /
``dense_4h_to_h``), run either one after another (Megatron's ``SequentialMLP``) or, with
``moe_grouped_gemm``, as two grouped GEMMs over all of them (``torch._grouped_mm`` on CUDA
where the build has it; the per-expert loop elsewhere: the same parameters and numbers).

Each expert is split over the expert tensor-parallel group (ETP) as the dense MLP is over TP,
but its linears communicate nothing (Megatron's ``explicit_expert_comm``): the token dispatcher
gathers their inputs and sums their partial outputs.

Legend: N tokens routed to this rank's experts (sorted by expert), h hidden, f expert hidden
size, L local experts.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.tensor_parallel.utils import ProcessGroup, tp_world_size
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.mlp import MLP


def expert_config(config: TransformerConfig, ffn_hidden_size: int,
                  sequence_parallel: bool) -> TransformerConfig:
    """``config`` for one expert MLP: its own hidden size; the routed experts see permuted
    tokens, never sequence-split rows."""
    return dataclasses.replace(config, ffn_hidden_size=ffn_hidden_size,
                               sequence_parallel=sequence_parallel)


def grouped_mm_available(x: torch.Tensor) -> bool:
    """``torch._grouped_mm`` runs here: a CUDA tensor in bf16 on a build that has it."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


class Experts(torch.nn.Module):
    """``num_local_experts`` MLPs of ``moe_ffn_hidden_size``, split over ``tp_group`` (the
    expert tensor-parallel group) as the dense MLP is over TP, without its collectives.

    Args:
        config: transformer settings.
        num_local_experts: experts on this rank.
        tp_group: the expert tensor-parallel group.
    """

    def __init__(self, config: TransformerConfig, num_local_experts: int,
                 tp_group: ProcessGroup | None) -> None:
        super().__init__()
        cfg = expert_config(config, config.moe_ffn_hidden_size, sequence_parallel=False)
        self.grouped = config.moe_grouped_gemm
        self.tp_group = tp_group
        self.tp_size = tp_world_size(tp_group)
        self.local_experts = torch.nn.ModuleList(MLP(cfg, tp_group, explicit_expert_comm=True)
                                                 for _ in range(num_local_experts))

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """``tokens [N, h]`` sorted by local expert, ``tokens_per_expert`` their counts ->
        ``[N, h]``: each expert's output, biases added, as this rank's partial sum over the
        expert TP group (whole at ETP 1)."""
        if self.grouped and grouped_mm_available(tokens) and self._plain_swiglu_or_gelu():
            return self._grouped(tokens, tokens_per_expert)
        outputs = []
        for expert, chunk in zip(self.local_experts, torch.split(tokens, tokens_per_expert)):
            out, bias = expert(chunk)
            outputs.append(out if bias is None else out + self._share_of(bias))
        return torch.cat(outputs, dim=0) if outputs else tokens[:0]

    def _share_of(self, bias: torch.Tensor) -> torch.Tensor:
        """This rank's part of fc2's (replicated) bias in the partial sum: ``1/ETP`` of it, so
        that the dispatcher's sum over ETP adds it once; its gradient is summed over ETP in
        the backward (each rank's is ``1/ETP`` of the whole), so the replicas stay equal."""
        if self.tp_size == 1:
            return bias
        return copy_to_tensor_model_parallel_region(bias, self.tp_group) / self.tp_size

    def _plain_swiglu_or_gelu(self) -> bool:
        first = self.local_experts[0]
        return first.dense_h_to_4h.bias is None and not first.squared_relu

    def _grouped(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """Both GEMMs of all local experts as one ``torch._grouped_mm`` each."""
        offsets = torch.tensor(tokens_per_expert, device=tokens.device).cumsum(0).int()
        w1 = torch.stack([e.dense_h_to_4h.weight for e in self.local_experts])  # [L, f', h]
        w2 = torch.stack([e.dense_4h_to_h.weight for e in self.local_experts])  # [L, h, f]
        inter = torch._grouped_mm(tokens, w1.transpose(1, 2), offs=offsets)  # [N, f']
        first = self.local_experts[0]
        if first.swiglu:
            gate, up = torch.chunk(inter, 2, dim=-1)
            inter = F.silu(gate) * up
        else:
            inter = F.gelu(inter, approximate=first.approximate)
        return torch._grouped_mm(inter, w2.transpose(1, 2), offs=offsets)  # [N, h]
