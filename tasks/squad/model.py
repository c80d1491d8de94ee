"""The SQuAD span head on BERT (Google's ``create_model`` in ``run_squad.py``; HF's
``BertForQuestionAnswering``): ``Linear(h, 2)`` over every position of the final hidden states
gives a start and an end logit per token; the loss is the mean of the two cross entropies.

No pooler (the span head reads every position, not [CLS]'s pooled vector) and no dropout
before the head (as both recipes). Checkpoint section ``qa_head`` (replicated on the TP ranks).
Loading a pretrained BERT (``--pretrained-checkpoint``) drops its pooler and pretraining heads
and keeps the new head's initialization (:class:`~megatron.core.models.classification.BertWithHead`).

Legend: b batch, s sequence, h hidden.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from megatron.core import comm, parallel_state
from megatron.core.models.classification import BertWithHead
from megatron.core.models.language_model import replicated_linear
from megatron.core.models.builder import build_model_stage
from megatron.core.tensor_parallel.utils import ProcessGroup
from megatron.core.transformer.config import TransformerConfig
from tasks.finetune_utils import batch_to_device, finetune_transformer_config


class QuestionAnswering(BertWithHead):
    """BERT -> ``logits [b, s, 2]`` (start, end) from each position's final hidden state."""

    head_key = "qa_head"

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None,
                 **kwargs) -> None:
        super().__init__(config, tp_group, add_pooler=False, **kwargs)

    def build_head(self, config: TransformerConfig) -> None:
        self.qa_head = replicated_linear(config.hidden_size, 2, config)

    def head(self, hidden: torch.Tensor, pooled: torch.Tensor | None) -> torch.Tensor:
        logits = self.qa_head(hidden)  # [s, b, 2]
        return logits.transpose(0, 1).contiguous()  # [b, s, 2]


def squad_model_provider(cfg, pre_process: bool = True,
                         post_process: bool = True) -> QuestionAnswering:
    """This rank's :class:`QuestionAnswering` stage (``finetune``'s model provider)."""
    return build_model_stage(QuestionAnswering, finetune_transformer_config(cfg),
                             pre_process=pre_process, post_process=post_process)


def span_loss_func(start_positions: torch.Tensor, end_positions: torch.Tensor,
                   dp_group: ProcessGroup | None, logits: torch.Tensor):
    """``(CE(start) + CE(end)) / 2`` in fp32 over ``logits [b, s, 2]``; reported as ``lm loss``
    (Megatron's finetuning log name), averaged over ``dp_group``."""
    start_logits, end_logits = logits.float().unbind(dim=-1)  # [b, s] each
    loss = (F.cross_entropy(start_logits, start_positions.long())
            + F.cross_entropy(end_logits, end_positions.long())) / 2
    reported = loss.detach().clone().view(1)
    comm.all_reduce(reported, dp_group, op="avg")
    return loss, {"lm loss": reported}


def span_forward_step(data_iterator: Iterator[dict], model):
    """The schedule's forward step: ``model(text, padding_mask, types)`` -> start/end logits,
    loss against the batch's ``start``/``end`` positions."""
    batch = batch_to_device(next(data_iterator))
    logits = model(batch["text"].long(), batch["padding_mask"].long(),
                   tokentype_ids=batch["types"].long())
    return logits, functools.partial(span_loss_func, batch["start"], batch["end"],
                                     parallel_state.get_data_parallel_group())
