"""Pieces every Megatron language model shares: the embedding + encoder container whose
parameter names are Megatron-LM's checkpoint keys (``language_model.embedding.*``,
``language_model.encoder.*``, BERT's ``language_model.pooler.*``,
``language_model.output_layer.*``), the logits projection, and the legacy checkpoint-dict
(de)nesting.

Legend: s sequence, b batch, h hidden, V padded vocabulary, p TP size.
"""

from __future__ import annotations

import torch

from megatron.core import comm
from megatron.core import device as device_mod
from megatron.core.models.embedding import Embedding
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                                    gather_from_tensor_model_parallel_region)
from megatron.core.tensor_parallel.utils import (ProcessGroup, set_defaults_if_not_set,
                                                 tp_world_size)
from megatron.core.transformer.block import TransformerBlock
from megatron.core.transformer.config import AttnMaskType, TransformerConfig
from megatron.core.transformer.context_parallel import split_for_cp
from megatron.core.transformer.moe.moe_layer import ExpertGroups
from megatron.core.transformer.rotary import RotaryEmbedding


def parallel_lm_logits(hidden: torch.Tensor, weight: torch.Tensor,
                       tp_group: ProcessGroup | None, parallel_output: bool = True,
                       bias: torch.Tensor | None = None,
                       sequence_parallel: bool = False,
                       gradient_accumulation_fusion: bool = False) -> torch.Tensor:
    """``hidden [s, b, h]`` x vocab-split ``weight [V/p, h]`` (+ vocab-split ``bias [V/p]``,
    BERT's LM head) -> ``[s, b, V/p]`` (or gathered ``[s, b, V]``); a column-parallel linear
    whose weight is the (tied) word embedding. With ``sequence_parallel`` the hidden states are
    this rank's ``[s/p, b, h]`` rows, all-gathered first (as Megatron's output layer). With
    ``gradient_accumulation_fusion`` the weight gradient goes straight into
    ``weight.main_grad`` (the DDP buffer) where there is one, as for every other linear."""
    logits = tp_layers.column_parallel_linear(hidden, weight, bias, tp_group,
                                              gradient_accumulation_fusion,
                                              sequence_parallel)  # [s, b, V/p]
    if parallel_output:
        return logits
    return gather_from_tensor_model_parallel_region(logits, tp_group)  # [s, b, V]


def replicated_linear(in_features: int, out_features: int, config: TransformerConfig
                      ) -> torch.nn.Linear:
    """Megatron's ``get_linear_layer``: a plain ``Linear`` whole on every TP rank, built on the
    CPU (so torch's own init draws from the default generator, as in Megatron), then weight
    N(0, ``init_method_std``) and bias zero. The draws are the same on all TP ranks, so TP = 1
    and TP = 2 build the same model. BERT's pooler and heads use it."""
    layer = torch.nn.Linear(in_features, out_features,
                            dtype=tp_layers.master_dtype(config.params_dtype))
    tp_layers.init_method_normal(config.init_method_std)(layer.weight.data)
    layer.bias.data.zero_()
    layer.to(dtype=config.params_dtype, device=device_mod.get_device())
    for param in layer.parameters():
        set_defaults_if_not_set(param)
    return layer


class Pooler(torch.nn.Module):
    """BERT's pooler (Megatron's ``Pooler``): the hidden state of one position (the first,
    ``[CLS]``) -> dense -> tanh. State-dict names: ``dense.weight``, ``dense.bias``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.dense = replicated_linear(config.hidden_size, config.hidden_size, config)

    def forward(self, hidden: torch.Tensor, sequence_index: int = 0) -> torch.Tensor:
        """``hidden [s, b, h]`` -> ``[b, h]``."""
        return torch.tanh(self.dense(hidden[sequence_index]))


class OutputLayer(torch.nn.Module):
    """The untied output layer: its vocabulary-split weight ``[V/p, h]`` (state-dict name
    ``weight``, drawn as a column-parallel linear's). It has no forward of its own: the logits
    are :func:`parallel_lm_logits` of this weight, as of the tied embedding."""

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None) -> None:
        super().__init__()
        self.weight = tp_layers.column_parallel_weight(
            config.padded_vocab_size, config.hidden_size, tp_group=tp_group,
            init_method=tp_layers.init_method_normal(config.init_method_std),
            params_dtype=config.params_dtype, **tp_layers.init_options(config))


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
        add_pooler: the last stage also returns the pooled first position (BERT with its
            binary head): ``forward`` then returns ``(hidden, pooled)``.
        replicated_head: the last stage's head is replicated on every TP rank and reads every
            position (BERT's pooler and heads): with sequence parallelism the final hidden
            states are all-gathered to ``[s, b, h]`` for it (GPT's output layer gathers them
            itself, as a column-parallel linear).
    """

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None, *,
                 pre_process: bool = True, post_process: bool = True,
                 num_layers: int | None = None, layer_offset: int = 0,
                 attn_mask_type: AttnMaskType = "causal", add_pooler: bool = False,
                 replicated_head: bool = False, cp_group: ProcessGroup | None = None,
                 expert_groups: ExpertGroups | None = None) -> None:
        super().__init__()
        self.cp_group = cp_group
        self.pre_process, self.post_process = pre_process, post_process
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel
        self.gather_sequence = post_process and replicated_head and config.sequence_parallel
        self.embedding = Embedding(config, tp_group) if pre_process else None
        self.encoder = TransformerBlock(config, tp_group, num_layers=num_layers,
                                        layer_offset=layer_offset, pre_process=pre_process,
                                        post_process=post_process,
                                        attn_mask_type=attn_mask_type, cp_group=cp_group,
                                        expert_groups=expert_groups)
        # RoPE holds no parameters: every stage has one, for its own layers' queries and keys.
        self.rotary_pos_emb = None
        if config.position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(config.kv_channels, config.rotary_percent,
                                                  config.rotary_interleaved, config.rotary_base)
        self.max_position_embeddings = config.max_position_embeddings or 0
        self.activation_dtype = config.params_dtype  # of the queries and keys RoPE rotates
        # Built after the encoder, as Megatron's, so the default generator's draws match.
        self.pooler = Pooler(config) if post_process and add_pooler else None
        self.output_layer = None
        if post_process and config.untie_embeddings_and_output_weights:
            self.output_layer = OutputLayer(config, tp_group)

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        self.encoder.set_input_tensor(input_tensor)

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                attention_mask: torch.Tensor | None,
                tokentype_ids: torch.Tensor | None = None,
                inference_params=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``[b, s]`` ids -> hidden ``[s, b, h]`` (final-LayerNorm-ed on the last stage);
        ``inference_params``: the generation KV cache. With a pooler (BERT's last stage):
        ``(hidden [s, b, h], pooled [b, h])``."""
        hidden = None
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids, tokentype_ids)  # [s, b, h]
        rotary = None
        if self.rotary_pos_emb is not None:
            # Megatron-LM's angles: the position in the sequence (after the cache's offset while
            # decoding), not position_ids, which later stages do not get while generating.
            offset = getattr(inference_params, "sequence_len_offset", 0)
            if position_ids is not None:
                seq = position_ids.size(1)
            else:  # [s, b, h] from the previous stage ([s/p, b, h] with sequence parallelism)
                seq = self.encoder.input_tensor.size(0) * self._sequence_split()
            cp, cp_rank = comm.world_size(self.cp_group), comm.rank(self.cp_group)
            rotary = self.rotary_pos_emb(seq * cp, offset,
                                         min_length=self.max_position_embeddings,
                                         device=device_mod.get_device(),
                                         dtype=self.activation_dtype)  # 2 x [S, 1, 1, rot]
            # Context parallelism: this rank's rows are global chunks r and 2 CP - r - 1.
            rotary = tuple(split_for_cp(t, 0, cp, cp_rank) for t in rotary)  # 2 x [s, 1, 1, rot]
        hidden = self.encoder(hidden, attention_mask, inference_params, rotary)
        if self.gather_sequence:
            # Every rank computes the replicated head's whole gradient: backward keeps its rows.
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group,
                                                          grad_is_partial=False)  # [s, b, h]
        if self.pooler is None:
            return hidden
        return hidden, self.pooler(hidden)

    def _sequence_split(self) -> int:
        """How many ranks the stage input's sequence is split over (sequence parallelism)."""
        return tp_world_size(self.tp_group) if self.sequence_parallel else 1

    def state_dict_for_save_checkpoint(self) -> dict:
        """Megatron-LM's nested layout: ``embedding`` -> ``{word_embeddings: {weight}, ...}``,
        ``encoder`` -> flat ``{'layers.0....': tensor}``, ``pooler`` -> ``{dense.weight, ...}``,
        ``output_layer`` -> ``{weight}``."""
        out: dict = {}
        if self.embedding is not None:
            out["embedding"] = {name: module.state_dict()
                                for name, module in self.embedding.named_children()}
        out["encoder"] = self.encoder.state_dict()
        if self.pooler is not None:
            out["pooler"] = self.pooler.state_dict()
        if self.output_layer is not None:
            out["output_layer"] = self.output_layer.state_dict()
        return out
