"""The GPT stage of this rank from the validated flags, for the entry points
(``pretrain_gpt.py``'s model provider, ``tools/generate.py``) and its FLOPs per sample.

``megatron.core`` never reads the CLI config: the flags reach it as a
:class:`~megatron.core.transformer.config.TransformerConfig`
(:func:`megatron.config.core_configs.transformer_config`).
"""

from __future__ import annotations

from megatron.config.core_configs import transformer_config
from megatron.core.flops import num_floating_point_operations
from megatron.core.models.gpt import GPTModel, gpt_model_stage


def gpt_model_from(cfg, pre_process: bool | None = None, post_process: bool | None = None,
                   ) -> GPTModel:
    """This rank's GPT stage from a validated ``MegatronConfig`` (groups from parallel_state;
    see :func:`~megatron.core.models.gpt.gpt_model_stage`, and seed first)."""
    return gpt_model_stage(transformer_config(cfg), pre_process=pre_process,
                           post_process=post_process)


def gpt_flops_per_sample(cfg) -> float:
    """Model FLOPs of one GPT training sample of ``--seq-length`` tokens (forward + backward;
    recomputation not counted)."""
    return num_floating_point_operations(transformer_config(cfg), batch_size=1,
                                         seq_length=cfg.data.seq_length)
