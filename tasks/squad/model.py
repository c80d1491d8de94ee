"""SQuAD's model and loss for ``finetune``: the span head on BERT
(:class:`~megatron.core.models.bert_heads.QuestionAnswering`, with the other finetuning heads)
built from the task's config, and the loss, the mean of the start and end cross entropies (as
Google's ``run_squad.py`` and HF's ``BertForQuestionAnswering``).

Loading a pretrained BERT (``--pretrained-checkpoint``) drops its pooler and pretraining heads
and keeps the new head's initialization (:class:`~megatron.core.models.bert_heads.BertWithHead`).

Legend: b batch, s sequence.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.bert_heads import QuestionAnswering
from megatron.core.models.builder import build_model_stage
from megatron.core.tensor_parallel.utils import ProcessGroup
from tasks.finetune_utils import finetune_transformer_config
from tasks.forward_step import bert_forward_step, reported_loss


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
    return loss, reported_loss(loss, dp_group)


def span_loss(batch: dict, logits: torch.Tensor):
    """:func:`span_loss_func` against the batch's ``start``/``end`` positions."""
    return span_loss_func(batch["start"], batch["end"],
                          parallel_state.get_data_parallel_group(), logits)


span_forward_step = functools.partial(bert_forward_step, loss_func=span_loss)
"""The schedule's forward step: start/end logits, the span loss."""
