"""Learning-rate and weight-decay schedule (Megatron's OptimizerParamScheduler).

Steps are counted in samples: each successful iteration advances the schedule by the global
batch size, so ``--lr-warmup-iters`` / ``--lr-decay-iters`` are multiplied by the global batch.
"""

from __future__ import annotations

import math

from megatron.core.log import log_rank_0


class OptimizerParamScheduler:
    """Warm-up then constant / linear / cosine / inverse-square-root decay; weight-decay increment.

    Args:
        optimizer: anything with ``param_groups`` (each may carry ``lr_mult`` / ``wd_mult``).
        max_lr: peak learning rate. min_lr: floor.
        lr_warmup_steps / lr_decay_steps: in samples.
        start_wd / end_wd / wd_incr_steps / wd_incr_style: weight-decay increment.
        use_checkpoint_opt_param_scheduler: on load, take values from the checkpoint (default
            False, as Megatron: a value that differs from the checkpoint's is an error).
        override_opt_param_scheduler: on load, keep the values given here.
    """

    def __init__(self, optimizer, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str, start_wd: float, end_wd: float,
                 wd_incr_steps: int, wd_incr_style: str,
                 use_checkpoint_opt_param_scheduler: bool = False,
                 override_opt_param_scheduler: bool = False) -> None:
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= --min-lr ({min_lr}) <= --lr ({max_lr})")
        if lr_decay_steps <= 0:
            raise ValueError(f"the learning-rate decay length ({lr_decay_steps} samples) must be "
                             "positive: check --lr-decay-iters/--lr-decay-samples/--train-iters")
        if lr_warmup_steps >= lr_decay_steps:
            raise ValueError(f"the warm-up ({lr_warmup_steps} samples) must be shorter than the "
                             f"decay ({lr_decay_steps} samples): check --lr-warmup-* and "
                             "--lr-decay-*")
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self.step(0)

    def get_wd(self) -> float:
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        elif self.wd_incr_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        else:
            raise ValueError(f"unknown --weight-decay-incr-style {self.wd_incr_style}")
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self) -> float:
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.max_lr * self.num_steps / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return self.max_lr
        if self.num_steps > self.lr_decay_steps:
            return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup = max(self.lr_warmup_steps, 1)
            steps = max(self.num_steps, 1)
            return max(self.min_lr, self.max_lr * warmup ** 0.5 / steps ** 0.5)
        ratio = (self.num_steps - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            raise ValueError(f"unknown --lr-decay-style {self.lr_decay_style}")
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int) -> None:
        """Advance by ``increment`` samples and set every param group's lr and weight decay."""
        self.num_steps += increment
        lr, wd = self.get_lr(), self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {"max_lr": self.max_lr, "lr_warmup_steps": self.lr_warmup_steps,
                "num_steps": self.num_steps, "lr_decay_style": self.lr_decay_style,
                "lr_decay_steps": self.lr_decay_steps, "min_lr": self.min_lr,
                "start_wd": self.start_wd, "end_wd": self.end_wd,
                "wd_incr_style": self.wd_incr_style, "wd_incr_steps": self.wd_incr_steps}

    def _check_and_set(self, name: str, ours, theirs):
        if self.override_opt_param_scheduler:
            log_rank_0(f" > overriding {name} value to {ours}")  # Megatron-LM's line
            return ours
        if not self.use_checkpoint_opt_param_scheduler and ours != theirs:
            raise ValueError(
                f"the checkpoint's learning-rate schedule has {name}={theirs} but the flags give "
                f"{ours}: pass --override-opt_param-scheduler to keep the flags' value or "
                "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
        if ours != theirs:
            log_rank_0(f" > using checkpoint value {theirs} for {name} (flags said {ours})")
        return theirs

    def load_state_dict(self, sd: dict) -> None:
        """Restore from a checkpoint (also Megatron's older key names)."""
        max_lr = sd.get("max_lr", sd.get("start_lr"))
        self.max_lr = self._check_and_set("learning rate", self.max_lr, max_lr)
        self.min_lr = self._check_and_set("minimum learning rate", self.min_lr, sd["min_lr"])
        warmup = sd.get("lr_warmup_steps", sd.get("warmup_steps", sd.get("warmup_iter")))
        self.lr_warmup_steps = self._check_and_set("warmup steps", self.lr_warmup_steps, warmup)
        decay = sd.get("lr_decay_steps", sd.get("decay_steps", sd.get("end_iter")))
        self.lr_decay_steps = self._check_and_set("total number of decay steps",
                                                  self.lr_decay_steps, decay)
        style = sd.get("lr_decay_style", sd.get("decay_style"))
        self.lr_decay_style = self._check_and_set("learning rate decay style",
                                                  self.lr_decay_style, style)
        if "start_wd" in sd:
            self.start_wd = self._check_and_set("start weight decay", self.start_wd, sd["start_wd"])
            self.end_wd = self._check_and_set("end weight decay", self.end_wd, sd["end_wd"])
            self.wd_incr_steps = self._check_and_set("total number of weight decay increment "
                                                     "steps", self.wd_incr_steps, sd["wd_incr_steps"])
            self.wd_incr_style = self._check_and_set("weight decay increment style",
                                                     self.wd_incr_style, sd["wd_incr_style"])
        num_steps = sd.get("num_steps", sd.get("num_iters"))
        self.num_steps = 0
        self.step(num_steps)
