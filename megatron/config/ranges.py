"""The allowed interval of every numeric flag, checked by validate() before anything else.

A value outside its range fails here, naming the flag, and not as a torch or numpy error after
the model is built (or as a division by zero in the derivations that follow).
"""

from __future__ import annotations

import dataclasses
import math

from megatron.config.base import flag_name


@dataclasses.dataclass(frozen=True)
class _Range:
    """The values a numeric flag allows: an interval; a float must also be finite (argparse's
    ``float`` accepts "nan" and "inf")."""

    text: str
    """What the error message says the value must be."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)


_POSITIVE_INT = _Range("a positive integer", low=1)
_NON_NEGATIVE_INT = _Range("an integer >= 0", low=0)
_POSITIVE = _Range("a finite number > 0", low=0, low_open=True)
_NON_NEGATIVE = _Range("a finite number >= 0 (not negative)", low=0)
_PROBABILITY = _Range("a probability in [0, 1]", low=0, high=1)
_BELOW_ONE = _Range("in [0, 1)", low=0, high=1, high_open=True)
_FRACTION = _Range("in (0, 1]", low=0, high=1, low_open=True)
# The C++ index builders take the seed as an int32.
_SEED = _Range("in [0, 2**31 - 1]", low=0, high=2**31 - 1)

# Every numeric flag with a range, checked first whenever the value is set (not None), so that a
# value outside it fails here and not as a torch or numpy error after the model is built.
# tests/config/test_ranges.py checks that every int/float field is listed, except the flags
# refused whatever their value (megatron.config.refusals: deprecated, or not built).
RANGES: dict[tuple[str, str], _Range] = {
    **{("model", name): _POSITIVE_INT for name in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
        "max_position_embeddings", "make_vocab_size_divisible_by", "num_query_groups",
        "rotary_base")},
    ("model", "rotary_percent"): _FRACTION,
    ("model", "layernorm_epsilon"): _POSITIVE,
    # p = 1 would scale the kept activations by 1 / (1 - p).
    ("model", "attention_dropout"): _BELOW_ONE,
    ("model", "hidden_dropout"): _BELOW_ONE,
    ("model", "seed"): _SEED,
    ("model", "init_method_std"): _POSITIVE,
    **{("model", name): _POSITIVE_INT for name in (
        "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
        "moe_router_topk", "moe_router_num_groups", "moe_router_group_topk")},
    **{("model", name): _NON_NEGATIVE for name in (
        "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate")},
    **{("model", name): _POSITIVE for name in (
        "moe_router_topk_scaling_factor", "moe_input_jitter_eps", "moe_expert_capacity_factor")},
    ("model", "num_experts"): _NON_NEGATIVE_INT,  # 0, as unset, is a dense model
    ("parallel", "expert_model_parallel_size"): _POSITIVE_INT,
    ("parallel", "expert_tensor_parallel_size"): _POSITIVE_INT,
    ("parallel", "tensor_model_parallel_size"): _POSITIVE_INT,
    ("parallel", "pipeline_model_parallel_size"): _POSITIVE_INT,
    ("parallel", "context_parallel_size"): _POSITIVE_INT,
    ("parallel", "num_layers_per_virtual_pipeline_stage"): _POSITIVE_INT,
    ("parallel", "distributed_timeout_minutes"): _POSITIVE_INT,
    ("parallel", "watchdog_timeout_seconds"): _POSITIVE,
    ("parallel", "local_rank"): _NON_NEGATIVE_INT,
    **{("training", name): _POSITIVE_INT for name in (
        "micro_batch_size", "global_batch_size", "recompute_num_layers", "train_iters",
        "train_samples", "exit_duration_in_mins", "eval_interval")},
    # 0 means "never", as in Megatron-LM's scripts.
    ("training", "exit_interval"): _NON_NEGATIVE_INT,
    ("training", "eval_iters"): _NON_NEGATIVE_INT,
    ("optimizer", "lr"): _NON_NEGATIVE,
    ("optimizer", "lr_decay_iters"): _POSITIVE_INT,
    ("optimizer", "lr_decay_samples"): _POSITIVE_INT,
    ("optimizer", "lr_warmup_fraction"): _BELOW_ONE,
    ("optimizer", "lr_warmup_iters"): _NON_NEGATIVE_INT,
    ("optimizer", "lr_warmup_samples"): _NON_NEGATIVE_INT,
    **{("optimizer", name): _NON_NEGATIVE for name in (
        "min_lr", "weight_decay", "start_weight_decay", "end_weight_decay", "clip_grad")},
    # torch.optim's own bounds (beta = 1 never forgets; momentum = 1 never decays).
    ("optimizer", "adam_beta1"): _BELOW_ONE,
    ("optimizer", "adam_beta2"): _BELOW_ONE,
    ("optimizer", "sgd_momentum"): _BELOW_ONE,
    ("optimizer", "adam_eps"): _POSITIVE,
    **{("precision", name): _POSITIVE for name in (
        "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window")},
    ("precision", "hysteresis"): _POSITIVE_INT,
    **{("data", name): _POSITIVE_INT for name in (
        "seq_length", "encoder_seq_length", "decoder_seq_length")},
    ("data", "sample_rate"): _FRACTION,
    ("data", "mask_prob"): _PROBABILITY,
    ("data", "short_seq_prob"): _PROBABILITY,
    ("data", "num_workers"): _NON_NEGATIVE_INT,
    ("tokenizer", "vocab_size"): _POSITIVE_INT,
    ("tokenizer", "vocab_extra_ids"): _NON_NEGATIVE_INT,
    ("checkpoint", "save_interval"): _NON_NEGATIVE_INT,
    ("checkpoint", "ckpt_step"): _NON_NEGATIVE_INT,
    ("logging", "log_interval"): _POSITIVE_INT,
    ("logging", "tensorboard_log_interval"): _POSITIVE_INT,
    ("logging", "tensorboard_queue_size"): _POSITIVE_INT,
}


def check_ranges(cfg) -> None:
    """Every value set against its range in :data:`RANGES`, naming the flag as spelled."""
    for (section, name), allowed in RANGES.items():
        sec = getattr(cfg, section)
        value = getattr(sec, name)
        if value is None or value in allowed:
            continue
        field = next(f for f in dataclasses.fields(sec) if f.name == name)
        typed = getattr(cfg, "given", {}).get(name, flag_name(field))
        raise ValueError(f"{typed} ({value}) must be {allowed.text}")
