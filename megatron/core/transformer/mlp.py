"""The MLP split over TP ranks (paper, figure 3a): column-parallel h -> ffn, GeLU on the local
slice (no communication), row-parallel ffn -> h (one all-reduce).

Legend: s sequence, b batch, h hidden, f ffn_hidden_size, p TP size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_gelu import bias_gelu
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel.utils import ProcessGroup
from megatron.core.transformer.config import TransformerConfig


class MLP(torch.nn.Module):
    """Megatron-LM's ``ParallelMLP``; parameter names ``dense_h_to_4h``, ``dense_4h_to_h``.

    Args:
        config: transformer settings (GeLU form: see ``TransformerConfig.gelu_tanh_approximation``).
        tp_group: the TP process group.
    """

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None) -> None:
        super().__init__()
        self.approximate = "tanh" if config.gelu_tanh_approximation else "none"
        # Megatron's condition: the fused bias-gelu needs a bias and is bypassed by the explicit
        # GeLU choices (--openai-gelu, --onnx-safe); both compute the same tanh GeLU.
        self.bias_gelu_fusion = (config.bias_gelu_fusion and config.add_bias_linear
                                 and not config.openai_gelu and not config.onnx_safe)
        self.dense_h_to_4h = tp_layers.ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size, tp_group=tp_group,
            init_method=tp_layers.init_method_normal(config.init_method_std),
            bias=config.add_bias_linear, gather_output=False, skip_bias_add=True,
            params_dtype=config.params_dtype,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            sequence_parallel=config.sequence_parallel)
        self.dense_4h_to_h = tp_layers.RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, tp_group=tp_group,
            init_method=tp_layers.scaled_init_method_normal(config.init_method_std,
                                                            config.num_layers),
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            params_dtype=config.params_dtype,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            sequence_parallel=config.sequence_parallel)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, h]`` -> (``[s, b, h]`` before the output bias, the output bias); with
        sequence parallelism ``[s/p, b, h]`` in and out, ``[s, b, f/p]`` inside."""
        intermediate, bias = self.dense_h_to_4h(hidden_states)  # [s, b, f/p]
        if self.bias_gelu_fusion:
            intermediate = bias_gelu(intermediate, bias)
        else:
            if bias is not None:
                intermediate = intermediate + bias
            intermediate = F.gelu(intermediate, approximate=self.approximate)
        return self.dense_4h_to_h(intermediate)
