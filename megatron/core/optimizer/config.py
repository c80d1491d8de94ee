"""What the optimizer layer needs to build a Megatron optimizer (Megatron-Core's OptimizerConfig).

The CLI layer fills it by copying same-named fields from the validated flags
(``megatron.config.core_configs.optimizer_config``); library users construct it directly.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig:
    """Optimizer choice and hyper-parameters, mixed precision and loss scaling."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """adam (AdamW, decoupled weight decay) or sgd."""
    lr: float | None = None
    """Initial learning rate of the torch optimizer (the LR scheduler sets the real value)."""
    weight_decay: float = 0.01
    """Weight decay of the decay group (biases and 1-D params get none)."""
    clip_grad: float = 1.0
    """Global L2 norm the gradients are clipped to (0 disables)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9

    fp16: bool = False
    """fp16 model params with fp32 main params and loss scaling."""
    bf16: bool = False
    """bf16 model params with fp32 main params."""
    params_dtype: torch.dtype = torch.float32
    """dtype of the model params (must agree with fp16/bf16)."""
    loss_scale: float | None = None
    """Constant loss scale (fp16); dynamic scaling when None."""
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    """Clean iterations before the dynamic loss scale grows."""
    hysteresis: int = 2
    """Overflowing iterations tolerated before the dynamic loss scale shrinks."""

    use_distributed_optimizer: bool = False
    """Shard main params and optimizer state over the data-parallel group (ZeRO-1)."""
    log_num_zeros_in_grad: bool = False
    """Count zero gradient elements each step."""
    barrier_with_L1_time: bool = True
    """Barrier before the level-1 optimizer timers stop (accurate, slightly slower)."""

    def __post_init__(self) -> None:
        half = self.fp16 or self.bf16
        if half != (self.params_dtype in (torch.float16, torch.bfloat16)):
            raise ValueError(f"params_dtype {self.params_dtype} does not match fp16 "
                             f"({self.fp16}) / bf16 ({self.bf16})")
