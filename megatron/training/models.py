"""The GPT or BERT stage of this rank from the validated flags, for the entry points
(``pretrain_gpt.py``'s and ``pretrain_bert.py``'s model providers, ``tools/generate.py``) and
their FLOPs per sample.

``megatron.core`` never reads the CLI config: the flags reach it as a
:class:`~megatron.core.transformer.config.TransformerConfig`
(:func:`megatron.config.core_configs.transformer_config`).
"""

from __future__ import annotations

import dataclasses

from megatron.config.core_configs import transformer_config
from megatron.core.flops import num_floating_point_operations
from megatron.core.models.bert import BertModel
from megatron.core.models.builder import build_model_stage
from megatron.core.models.gpt import GPTModel


def gpt_model_from(cfg, pre_process: bool | None = None, post_process: bool | None = None,
                   inference: bool = False) -> GPTModel:
    """This rank's GPT stage from a validated ``MegatronConfig`` (groups from parallel_state;
    see :func:`~megatron.core.models.builder.build_model_stage`, and seed first).

    ``inference`` (generation): ``--sequence-parallel`` is switched off, as Megatron's
    inference does: the KV cache and the last-token logits work on whole sequences of any
    length. It changes no weight, so a checkpoint trained with it loads the same.
    """
    config = transformer_config(cfg)
    if inference:
        config = dataclasses.replace(config, sequence_parallel=False)
    return build_model_stage(GPTModel, config, pre_process=pre_process,
                             post_process=post_process)


def gpt_flops_per_sample(cfg) -> float:
    """Model FLOPs of one GPT training sample of ``--seq-length`` tokens (forward + backward;
    recomputation not counted)."""
    return num_floating_point_operations(transformer_config(cfg), batch_size=1,
                                         seq_length=cfg.data.seq_length)


def bert_transformer_config(cfg):
    """The transformer config of BERT: Megatron-LM's pretrain_bert.py gives the model two
    token types with the binary head and none without (there is no --num-tokentypes flag)."""
    return dataclasses.replace(transformer_config(cfg),
                               num_tokentypes=2 if cfg.model.bert_binary_head else 0)


def bert_model_from(cfg, pre_process: bool | None = None, post_process: bool | None = None,
                    ) -> BertModel:
    """This rank's BERT stage from a validated ``MegatronConfig`` (groups from parallel_state;
    ``--bert-no-binary-head`` drops the pooler, the binary head and the token types; see
    :func:`~megatron.core.models.builder.build_model_stage`, and seed first)."""
    return build_model_stage(BertModel, bert_transformer_config(cfg),
                             add_binary_head=cfg.model.bert_binary_head,
                             pre_process=pre_process, post_process=post_process)


def bert_flops_per_sample(cfg) -> float:
    """Model FLOPs of one BERT training sample of ``--seq-length`` tokens (forward + backward;
    the transformer and a full-sequence logits layer, as for GPT: Megatron's count)."""
    return num_floating_point_operations(bert_transformer_config(cfg), batch_size=1,
                                         seq_length=cfg.data.seq_length)
