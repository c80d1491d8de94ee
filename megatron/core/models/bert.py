"""The BERT model (Megatron-LM's legacy ``BertModel``, paper section 5): word + position +
token-type embeddings, a bidirectional transformer under a padding mask, the final LayerNorm,
the masked-LM head (dense -> GeLU -> LayerNorm -> logits on the tied word embedding + its own
vocab-split bias) and, unless ``--bert-no-binary-head``, the pooler (first position -> dense ->
tanh) and the binary sentence-order head.

Both arrangements of the paper's figure 7 come from the transformer layer: the default
"rearranged" pre-LN layer, and with ``apply_residual_connection_post_layernorm`` the residual
taken after the LayerNorm -- which, layer after layer, is exactly the original BERT ordering
``LN(x + f(x))`` (the first layer's input LayerNorm plays BERT's embedding LayerNorm and the
final LayerNorm the last layer's output LayerNorm).

:class:`BertBody` is the part every BERT model shares (the finetuning heads of
:mod:`~megatron.core.models.bert_heads` build on it too); :class:`BertModel` adds the pretraining
heads. Parameter names are Megatron-LM's checkpoint keys: ``language_model.*`` (with
``language_model.embedding.tokentype_embeddings.weight`` and ``language_model.pooler.dense.*``),
``lm_head.{bias, dense.*, layernorm.*}``, ``binary_head.{weight, bias}``.

Legend: b batch, s sequence, h hidden, V padded vocabulary, p TP size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core import device as device_mod
from megatron.core.models.language_model import parallel_lm_logits, replicated_linear
from megatron.core.models.language_module import LanguageModule
from megatron.core.tensor_parallel.utils import (ProcessGroup, divide,
                                                 set_tensor_model_parallel_attributes,
                                                 tp_world_size)
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.layernorm import LayerNorm

__all__ = ["BertBody", "BertLMHead", "BertModel", "bert_extended_attention_mask",
           "bert_position_ids"]


def bert_extended_attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """``padding_mask [b, s]`` (1 = real token) -> bool ``[b, 1, s, s]``, True = masked: a
    query-key pair is masked when either side is padding (Megatron's
    ``bert_extended_attention_mask``)."""
    real = padding_mask.to(torch.bool)
    both = real.unsqueeze(1) & real.unsqueeze(2)  # [b, s, s]
    return ~both.unsqueeze(1)  # [b, 1, s, s]


def bert_position_ids(token_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` positions 0..s-1 for every sample."""
    positions = torch.arange(token_ids.size(1), dtype=torch.long, device=token_ids.device)
    return positions.unsqueeze(0).expand_as(token_ids)


class BertLMHead(torch.nn.Module):
    """Megatron's ``BertLMHead``: dense -> GeLU -> LayerNorm -> logits on the (tied, vocab-
    split) word embedding plus the head's own bias ``[V/p]`` (split over TP ranks like the
    embedding's rows). State-dict names: ``bias``, ``dense.*``, ``layernorm.*``.

    Args:
        vocab_per_partition: ``V/p``, the rows of this rank's word embedding.
        config: transformer settings (``openai_gelu``: tanh GeLU; otherwise the exact erf GeLU,
            as Megatron's head, which does not use the fused bias-GeLU of the MLP).
        tp_group: the TP process group.
        parallel_output: logits stay vocab-split.
    """

    def __init__(self, vocab_per_partition: int, config: TransformerConfig,
                 tp_group: ProcessGroup | None, parallel_output: bool = True) -> None:
        super().__init__()
        self.tp_group, self.parallel_output = tp_group, parallel_output
        self.bias = torch.nn.Parameter(torch.zeros(
            vocab_per_partition, dtype=config.params_dtype,
            device=device_mod.get_device()))
        set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
        self.dense = replicated_linear(config.hidden_size, config.hidden_size, config)
        self.layernorm = LayerNorm(config.hidden_size, eps=config.layernorm_epsilon,
                                   apply_layernorm_1p=config.apply_layernorm_1p,
                                   params_dtype=config.params_dtype)
        self.approximate = "tanh" if config.openai_gelu else "none"

    def forward(self, hidden: torch.Tensor, word_embeddings_weight: torch.Tensor,
                parallel_output: bool | None = None) -> torch.Tensor:
        """``hidden [s, b, h]`` (or ``[n, h]``) -> logits ``[s, b, V/p]`` (``[n, V/p]``)."""
        hidden = self.dense(hidden)
        hidden = F.gelu(hidden, approximate=self.approximate)
        hidden = self.layernorm(hidden)
        if parallel_output is None:
            parallel_output = self.parallel_output
        return parallel_lm_logits(hidden, word_embeddings_weight, self.tp_group,
                                  parallel_output, bias=self.bias)


class BertBody(LanguageModule):
    """The body every BERT model shares (pretraining, :mod:`~megatron.core.models.bert_heads`):
    word + position + token-type embeddings, the padding-masked bidirectional encoder, the final
    LayerNorm and, with ``add_pooler``, the pooler. Subclasses add their heads and ``forward``,
    running :meth:`encode` first.

    Args: see :class:`~megatron.core.models.language_module.LanguageModule`.
    """

    checkpoint_name = "BERT"
    attn_mask_type = "padding"
    replicated_head = True

    def encode(self, input_ids: torch.Tensor | None, padding_mask: torch.Tensor | None,
               tokentype_ids: torch.Tensor | None = None):
        """Run the body on this stage.

        Args:
            input_ids: ``[b, s]`` token ids (first stage; None elsewhere).
            padding_mask: ``[b, s]``, 1 = real token (or a ready bool ``[b, 1, s, s]`` mask).
            tokentype_ids: ``[b, s]`` segment ids (with ``num_tokentypes`` > 0).

        Returns:
            On the last stage ``(hidden [s, b, h], pooled [b, h] or None without a pooler)``;
            elsewhere the hidden ``[s, b, h]`` for the next stage.
        """
        mask = self.prepare_attention_mask(padding_mask)
        position_ids = None if input_ids is None else bert_position_ids(input_ids)
        output = self.language_model(input_ids, position_ids, mask, tokentype_ids)
        if not self.post_process:
            return output  # [s, b, h]
        return output if self.language_model.pooler is not None else (output, None)

    def prepare_attention_mask(self, attention_mask: torch.Tensor | None
                               ) -> torch.Tensor | None:
        """Padding mask ``[b, s]`` -> bool ``[b, 1, s, s]`` (a 4-d mask passes through); None
        when nothing is padded, so attention takes its unmasked (fastest) path."""
        if attention_mask is None or attention_mask.dim() == 4:
            return attention_mask
        if bool(attention_mask.all()):
            return None
        return bert_extended_attention_mask(attention_mask)


class BertModel(BertBody):
    """Megatron-LM's ``BertModel`` on one pipeline stage, split over TP ranks: the
    :class:`BertBody` and the pretraining heads.

    ``forward(bert_model_input, attention_mask, tokentype_ids=None, lm_labels=None)`` (Megatron's
    signature): ``bert_model_input`` token ids ``[b, s]``; ``attention_mask`` the padding mask
    ``[b, s]`` (1 = real token); ``tokentype_ids [b, s]`` (with ``num_tokentypes`` > 0);
    ``lm_labels [b, s]`` (-1 where nothing is predicted). Returns on the last stage
    ``(lm_loss [b, s] fp32, binary_logits [b, 2] | None)`` with labels (the loss at the
    predicted positions, 0 elsewhere: the training code weights it by the loss mask),
    ``(logits [b, s, V/p], binary_logits)`` without; on other stages the hidden ``[s, b, h]``.

    Args:
        config: transformer settings; ``num_tokentypes`` sets the token-type embedding (Megatron's
            pretrain_bert.py: 2 with the binary head, 0 without).
        tp_group: the TP process group.
        add_binary_head: build the pooler and the sentence-order head.
        kwargs: see :class:`LanguageModule` (``pre_process``, ``post_process``, ...).
    """

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None, *,
                 add_binary_head: bool = True, **kwargs) -> None:
        super().__init__(config, tp_group, add_pooler=add_binary_head, **kwargs)
        self.add_binary_head = add_binary_head  # read by pretrain_bert.py's forward step
        self.lm_head = None
        self.binary_head = None
        if self.post_process:
            vocab_per_partition = divide(config.padded_vocab_size, tp_world_size(tp_group))
            self.lm_head = BertLMHead(vocab_per_partition, config, tp_group,
                                      self.parallel_output)
            if add_binary_head:
                self.binary_head = replicated_linear(config.hidden_size, 2, config)
        self.set_parameter_defaults()

    def forward(self, bert_model_input: torch.Tensor | None,
                attention_mask: torch.Tensor | None,
                tokentype_ids: torch.Tensor | None = None,
                lm_labels: torch.Tensor | None = None):
        """See the class docstring."""
        output = self.encode(bert_model_input, attention_mask, tokentype_ids)
        if not self.post_process:
            return output  # [s, b, h]
        hidden, pooled = output
        binary_logits = self.binary_head(pooled) if self.binary_head is not None else None
        if lm_labels is None:
            logits = self.lm_head(hidden, self.output_weight())  # [s, b, V/p]
            return logits.transpose(0, 1).contiguous(), binary_logits  # [b, s, V/p]
        return self.masked_lm_loss(hidden, lm_labels), binary_logits

    def masked_lm_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross entropy ``[b, s]`` (fp32 unless ``fp16_lm_cross_entropy``) of the LM head at
        the predicted positions (``labels >= 0``); 0 elsewhere.

        Megatron computes the head and the loss at every position and the training code then
        multiplies the unpredicted ones by a zero loss mask; only the ~15% predicted rows go
        through the head here, so the ``[b s, V]`` logits (the largest GEMM of BERT-base's step)
        shrink to ``[n, V]``. The trained values are the same.
        """
        s, b, h = hidden.shape
        labels_sb = labels.transpose(0, 1).reshape(s * b)  # [s b], hidden's order
        rows = torch.nonzero(labels_sb >= 0).squeeze(1)  # [n]; the same on every TP rank
        selected = hidden.reshape(s * b, h).index_select(0, rows)  # [n, h]
        logits = self.lm_head(selected, self.output_weight(), parallel_output=True)  # [n, V/p]
        # The logits are a temporary nobody else reads: the loss overwrites them in place.
        picked = self.cross_entropy(logits, labels_sb.index_select(0, rows))  # [n]
        loss = torch.zeros(s * b, dtype=picked.dtype, device=picked.device)
        loss = loss.index_copy(0, rows, picked)  # [s b]
        return loss.view(s, b).transpose(0, 1).contiguous()  # [b, s]

    def extra_state_dict_sections(self) -> dict[str, dict]:
        """``lm_head`` and ``binary_head`` beside ``language_model`` (last stage only)."""
        out = {}
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head.state_dict()
        if self.binary_head is not None:
            out["binary_head"] = self.binary_head.state_dict()
        return out

