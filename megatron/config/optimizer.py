"""Optimizer, learning-rate schedule, weight decay and mixed-precision flags."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron.config.base import spec


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig:
    """Adam/SGD hyper-parameters, gradient clipping and the learning-rate/weight-decay schedule."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer: adam (AdamW, decoupled weight decay) or sgd."""
    lr: float | None = None
    """Peak learning rate (after warm-up)."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "linear"
    """Learning-rate decay after warm-up."""
    lr_decay_iters: int | None = None
    """Iterations to decay over; defaults to --train-iters."""
    lr_decay_samples: int | None = None
    """Samples to decay over; defaults to --train-samples."""
    lr_warmup_fraction: float | None = None
    """Warm-up length as a fraction of the decay length."""
    lr_warmup_iters: int = 0
    """Warm-up iterations."""
    lr_warmup_samples: int = 0
    """Warm-up samples."""
    warmup: int | None = None
    """Deprecated: use --lr-warmup-fraction."""
    min_lr: float = 0.0
    """Learning-rate floor of the decay."""
    override_opt_param_scheduler: bool = spec(False, flag="--override-opt_param-scheduler")
    """Take the schedule from the flags, ignoring the one in the checkpoint."""
    use_checkpoint_opt_param_scheduler: bool = spec(
        False, flag="--use-checkpoint-opt_param-scheduler")
    """Take the schedule from the checkpoint, ignoring the flags."""
    weight_decay: float = 0.01
    """Weight decay (not applied to biases and norms)."""
    start_weight_decay: float | None = None
    """Initial weight decay of a linear/cosine increment."""
    end_weight_decay: float | None = None
    """Final weight decay of a linear/cosine increment."""
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """How weight decay goes from start to end over the decay length."""
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm (0 disables)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    sgd_momentum: float = 0.9
    """SGD momentum."""


@dataclasses.dataclass(kw_only=True)
class MixedPrecisionConfig:
    """fp16/bf16 training, loss scaling and the precision of a few numerically sensitive ops."""

    fp16: bool = False
    """Train with fp16 parameters, fp32 main parameters and loss scaling."""
    bf16: bool = False
    """Train with bf16 parameters and fp32 main parameters."""
    loss_scale: float | None = None
    """Constant loss scale (fp16); dynamic scaling when unset."""
    initial_loss_scale: float = 2.0 ** 32
    """Initial dynamic loss scale."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale."""
    loss_scale_window: float = 1000
    """Clean iterations before the dynamic loss scale doubles."""
    hysteresis: int = 2
    """Overflowing iterations tolerated before the dynamic loss scale halves."""
    fp32_residual_connection: bool = False
    """Keep the residual stream in fp32."""
    attention_softmax_in_fp32: bool = False
    """Compute the attention softmax in fp32 with fp16/bf16 parameters. Acts on the unfused
    attention path (--attention-backend unfused); torch's SDPA already accumulates fp16/bf16
    scores and softmax in fp32 internally, as Megatron's fused kernels do."""
    accumulate_allreduce_grads_in_fp32: bool = False
    """Accumulate and all-reduce gradients in fp32 (always on with --bf16)."""
    fp16_lm_cross_entropy: bool = False
    """Compute the language-model cross entropy in fp16."""
