"""A stack of transformer layers with the final LayerNorm (Megatron-LM's ``ParallelTransformer``,
the ``encoder`` of the checkpoint), with full activation recomputation and pipeline hooks.

With ``compile_layers`` (``--compile-layers``) every layer runs through ``torch.compile``, and
a layer is one graph (tests/core/transformer/test_compile_layers.py counts graphs and breaks):
at TP>1 the tensor-parallel collectives are traced as functional collectives
(``tensor_parallel.mappings``). Only while their dropout is active, the attention core (and
with sequence parallelism the bias-dropout-adds) run eagerly under the per-rank RNG stream
(``tensor_parallel.random.run_in_tp_stream``), a graph break each; with context parallelism
the attention core always runs eagerly (``context_parallel_attention``), one break a layer.

Legend: s sequence, b batch, h hidden.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron.core.tensor_parallel.random import checkpoint
from megatron.core.tensor_parallel.utils import ProcessGroup
from megatron.core.transformer.attention import additive_mask
from megatron.core.transformer.config import AttnMaskType, TransformerConfig
from megatron.core.transformer.layer import TransformerLayer
from megatron.core.transformer.layernorm import build_norm
from megatron.core.transformer.moe.moe_layer import ExpertGroups


class TransformerBlock(torch.nn.Module):
    """``num_layers`` layers (numbered ``layer_offset + 1 ...``) and, on the last pipeline stage,
    ``final_layernorm``. State-dict names: ``layers.N.*`` (N local to the stage).

    Args:
        config: transformer settings.
        tp_group: the TP process group.
        num_layers: layers on this pipeline stage (default: all ``config.num_layers``).
        layer_offset: global index of this stage's first layer (pipeline parallelism).
        pre_process: this stage receives the embedding output as ``hidden_states``; otherwise
            the input comes from :meth:`set_input_tensor` (the previous pipeline stage).
        post_process: this stage applies the final LayerNorm.
        attn_mask_type: ``causal`` or ``padding``.
    """

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None,
                 num_layers: int | None = None, layer_offset: int = 0,
                 pre_process: bool = True, post_process: bool = True,
                 attn_mask_type: AttnMaskType = "causal",
                 cp_group: ProcessGroup | None = None,
                 expert_groups: ExpertGroups | None = None) -> None:
        super().__init__()
        self.config, self.tp_group = config, tp_group
        self.pre_process, self.post_process = pre_process, post_process
        n = config.num_layers if num_layers is None else num_layers
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config, layer_offset + i + 1, tp_group, attn_mask_type, cp_group,
                             expert_groups)
            for i in range(n))
        self.final_layernorm = None
        if post_process:
            self.final_layernorm = build_norm(config)
        # With sequence parallelism a checkpoint's input is already this rank's s/p rows:
        # nothing left to distribute (Megatron ignores the flag then too).
        self.distribute_saved_activations = (config.distribute_saved_activations
                                             and not config.sequence_parallel)
        self.input_tensor: torch.Tensor | None = None
        # --compile-layers: each layer compiled on its own, as torchtitan compiles per block, so
        # what surrounds the layers (pipeline stages, full recompute, the loss) stays eager. A
        # plain list, out of the module tree: the wrappers share the layers' parameters, and
        # state-dict names, .parameters() and .to() see the layers alone.
        self.compiled_layers = ([torch.compile(layer) for layer in self.layers]
                                if config.compile_layers else None)

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """The activation received from the previous pipeline stage (``[s, b, h]``)."""
        self.input_tensor = input_tensor

    def forward(self, hidden_states: torch.Tensor | None,
                attention_mask: torch.Tensor | None = None,
                inference_params=None, rotary_pos_emb: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]`` (LayerNorm-ed on the last stage); ``[s/p, b, h]`` in
        and out with sequence parallelism; ``inference_params`` is the generation KV cache and
        ``rotary_pos_emb`` the RoPE ``(cos, sin)``, both passed to every layer."""
        if not self.pre_process:
            hidden_states = self.input_tensor
        if attention_mask is not None and self.config.use_sdpa:
            # SDPA's additive form, built once for every layer (not once per layer).
            attention_mask = additive_mask(attention_mask, self.config.params_dtype)
        if self.config.recompute_granularity == "full" and self.training:
            hidden_states = self._checkpointed_forward(hidden_states, attention_mask,
                                                       rotary_pos_emb)
        else:
            for layer in self._runnable_layers(inference_params):
                hidden_states = layer(hidden_states, attention_mask, inference_params,
                                      rotary_pos_emb)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states

    def _checkpointed_forward(self, hidden_states: torch.Tensor,
                              attention_mask: torch.Tensor | None,
                              rotary_pos_emb: torch.Tensor | None = None) -> torch.Tensor:
        """Full recompute: ``uniform`` checkpoints chunks of ``recompute_num_layers`` layers;
        ``block`` checkpoints only the first ``recompute_num_layers`` layers of the stage."""
        cfg, n = self.config, len(self.layers)
        step = cfg.recompute_num_layers
        layers = self._runnable_layers(None)

        def run(start: int, end: int):
            def chunk(x, mask):
                for layer in layers[start:end]:
                    # The angles need no gradient: closed over, not a checkpoint input.
                    x = layer(x, mask, rotary_pos_emb=rotary_pos_emb)
                return x
            return chunk

        if cfg.recompute_method == "uniform":
            for start in range(0, n, step):
                hidden_states = checkpoint(run(start, min(start + step, n)),
                                           self.distribute_saved_activations, hidden_states,
                                           attention_mask, tp_group=self.tp_group)
            return hidden_states
        for i in range(n):  # block
            if i < step:
                hidden_states = checkpoint(run(i, i + 1), self.distribute_saved_activations,
                                           hidden_states, attention_mask, tp_group=self.tp_group)
            else:
                hidden_states = layers[i](hidden_states, attention_mask,
                                          rotary_pos_emb=rotary_pos_emb)
        return hidden_states

    def _runnable_layers(self, inference_params) -> Sequence[torch.nn.Module]:
        """The compiled layers (``compile_layers``) for training and evaluation forwards; the
        layers themselves for generation with a KV cache, whose Python-side cache updates and
        one-token steps would break and recompile the graphs."""
        if self.compiled_layers is None or inference_params is not None:
            return self.layers
        return self.compiled_layers
