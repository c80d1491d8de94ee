"""Pieces every Megatron language model shares: the embedding + encoder container whose
parameter names are Megatron-LM's checkpoint keys (``language_model.embedding.*``,
``language_model.encoder.*``, ``language_model.output_layer.*``), the logits projection, and
the legacy checkpoint-dict (de)nesting.

Legend: s sequence, b batch, h hidden, V padded vocabulary, p TP size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.models.embedding import Embedding
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_tensor_model_parallel_region)
from megatron.core.tensor_parallel.utils import ProcessGroup
from megatron.core.transformer.attention import causal_mask
from megatron.core.transformer.block import TransformerBlock
from megatron.core.transformer.config import AttnMaskType, TransformerConfig


def parallel_lm_logits(hidden: torch.Tensor, weight: torch.Tensor,
                       tp_group: ProcessGroup | None, parallel_output: bool = True
                       ) -> torch.Tensor:
    """``hidden [s, b, h]`` x vocab-split ``weight [V/p, h]`` -> ``[s, b, V/p]`` (or gathered
    ``[s, b, V]``); a column-parallel linear whose weight is the (tied) word embedding."""
    hidden = copy_to_tensor_model_parallel_region(hidden, tp_group)
    logits = F.linear(hidden, weight)  # [s, b, V/p]
    if parallel_output:
        return logits
    return gather_from_tensor_model_parallel_region(logits, tp_group)  # [s, b, V]


def is_plain_causal_mask(mask: torch.Tensor) -> bool:
    """True when ``mask`` (bool, True = masked) is the ordinary causal mask for every sample, so
    attention can use the faster ``is_causal`` path instead of an explicit mask."""
    if mask.dim() != 4 or mask.size(1) != 1 or mask.size(-1) != mask.size(-2):
        return False
    ref = causal_mask(mask.size(-1), mask.device)
    return bool(torch.equal(mask.to(torch.bool), ref.expand_as(mask)))


class TransformerLanguageModel(torch.nn.Module):
    """Embedding (first pipeline stage), encoder, and the untied output layer (last stage).

    Args:
        config: transformer and language-model settings.
        tp_group: the TP process group.
        pre_process: holds the embedding (first pipeline stage).
        post_process: holds the final LayerNorm and, if untied, the output layer (last stage).
        num_layers: layers on this stage (default all).
        layer_offset: global index of this stage's first layer.
        attn_mask_type: ``causal`` (GPT) or ``padding`` (BERT).
    """

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None, *,
                 pre_process: bool = True, post_process: bool = True,
                 num_layers: int | None = None, layer_offset: int = 0,
                 attn_mask_type: AttnMaskType = "causal") -> None:
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.embedding = Embedding(config, tp_group) if pre_process else None
        self.encoder = TransformerBlock(config, tp_group, num_layers=num_layers,
                                        layer_offset=layer_offset, pre_process=pre_process,
                                        post_process=post_process,
                                        attn_mask_type=attn_mask_type)
        self.output_layer = None
        if post_process and config.untie_embeddings_and_output_weights:
            self.output_layer = tp_layers.ColumnParallelLinear(
                config.hidden_size, config.padded_vocab_size, tp_group=tp_group, bias=False,
                init_method=tp_layers.init_method_normal(config.init_method_std),
                params_dtype=config.params_dtype)

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        self.encoder.set_input_tensor(input_tensor)

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                attention_mask: torch.Tensor | None,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``[b, s]`` ids -> hidden ``[s, b, h]`` (final-LayerNorm-ed on the last stage)."""
        hidden = None
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids, tokentype_ids)  # [s, b, h]
        return self.encoder(hidden, attention_mask)

    def state_dict_for_save_checkpoint(self) -> dict:
        """Megatron-LM's nested layout: ``embedding`` -> ``{word_embeddings: {weight}, ...}``,
        ``encoder`` -> flat ``{'layers.0....': tensor}``, ``output_layer`` -> ``{weight}``."""
        out: dict = {}
        if self.embedding is not None:
            out["embedding"] = {name: module.state_dict()
                                for name, module in self.embedding.named_children()}
        out["encoder"] = self.encoder.state_dict()
        if self.output_layer is not None:
            out["output_layer"] = self.output_layer.state_dict()
        return out
