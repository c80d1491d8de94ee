"""The MLP split over TP ranks (paper, figure 3a): column-parallel h -> ffn, GeLU on the local
slice (no communication), row-parallel ffn -> h (one all-reduce).

Legend: s sequence, b batch, h hidden, f ffn_hidden_size, p TP size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_gelu import bias_gelu
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel.utils import ProcessGroup
from megatron.core.transformer.config import TransformerConfig


class MLP(torch.nn.Module):
    """Megatron-LM's ``ParallelMLP``; parameter names ``dense_h_to_4h``, ``dense_4h_to_h``.

    Args:
        config: transformer settings (GeLU form: see ``TransformerConfig.gelu_tanh_approximation``).
        tp_group: the TP process group.
        explicit_expert_comm: the weights split over ``tp_group`` without a collective in
            either linear: a routed expert's, whose dispatcher moves its inputs and sums its
            partial outputs (``[s, b, h]`` partial sums out).
    """

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None,
                 explicit_expert_comm: bool = False) -> None:
        super().__init__()
        self.approximate = "tanh" if config.gelu_tanh_approximation else "none"
        self.swiglu, self.squared_relu = config.swiglu, config.squared_relu
        self.bias_swiglu_fusion = config.swiglu and config.bias_swiglu_fusion
        # Megatron's condition: the fused bias-gelu needs a bias and is bypassed by the explicit
        # GeLU choices (--openai-gelu, --onnx-safe); both compute the same tanh GeLU.
        self.bias_gelu_fusion = (config.bias_gelu_fusion and config.add_bias_linear
                                 and not config.openai_gelu and not config.onnx_safe
                                 and not config.swiglu and not config.squared_relu)
        # SwiGLU: fc1 is Megatron's one column-parallel linear of 2f outputs whose shard on
        # rank r is [gate_r; up_r] (f/p rows each), so the activation splits the local output
        # in halves. stride=2 lays the full (gathered) weight out as [gate; up], the TP=1
        # layout, so the initialization is the same at every TP size.
        self.dense_h_to_4h = tp_layers.ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size * (2 if config.swiglu else 1),
            tp_group=tp_group, stride=2 if config.swiglu else 1,
            init_method=tp_layers.init_method_normal(config.init_method_std),
            bias=config.add_bias_linear, gather_output=False, skip_bias_add=True,
            params_dtype=config.params_dtype,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            sequence_parallel=config.sequence_parallel, explicit_expert_comm=explicit_expert_comm,
            **tp_layers.init_options(config))
        self.dense_4h_to_h = tp_layers.RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, tp_group=tp_group,
            init_method=tp_layers.scaled_init_method_normal(config.init_method_std,
                                                            config.num_layers),
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            params_dtype=config.params_dtype,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            sequence_parallel=config.sequence_parallel, explicit_expert_comm=explicit_expert_comm,
            **tp_layers.init_options(config))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, h]`` -> (``[s, b, h]`` before the output bias, the output bias); with
        sequence parallelism ``[s/p, b, h]`` in and out, ``[s, b, f/p]`` inside."""
        intermediate, bias = self.dense_h_to_4h(hidden_states)  # [s, b, f/p] (2f/p: SwiGLU)
        if self.bias_swiglu_fusion:
            # Keeps fc1's output (and bias) alone for the backward, as Megatron's fusion.
            intermediate = bias_swiglu(intermediate, bias)  # [s, b, f/p]
        elif self.swiglu or self.squared_relu:
            if bias is not None:
                intermediate = intermediate + bias
            if self.swiglu:
                gate, up = torch.chunk(intermediate, 2, dim=-1)  # 2 x [s, b, f/p]
                intermediate = F.silu(gate) * up
            else:
                intermediate = torch.pow(F.relu(intermediate), 2)
        elif self.bias_gelu_fusion:
            intermediate = bias_gelu(intermediate, bias)
        else:
            if bias is not None:
                intermediate = intermediate + bias
            intermediate = F.gelu(intermediate, approximate=self.approximate)
        return self.dense_4h_to_h(intermediate)
