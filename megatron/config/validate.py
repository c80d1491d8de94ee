"""The one place where flag combinations are checked and derived values are set.

Runs before any process group starts (so a bad flag costs a second, not a rendezvous and a model
build). Every error is a ``ValueError`` whose message names the flags involved, the offending
value or path, and what to change.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import warnings

import torch

from megatron.config.base import flag_name, make_read_only
from megatron.core import device

# Megatron-LM flags that are accepted (so scripts parse) but whose feature is not built yet.
# Setting one to a non-default value is an error rather than a silent no-op.
NOT_IMPLEMENTED: dict[tuple[str, str], str] = {
    ("model", "num_experts"): "--num-experts",
    ("model", "encoder_num_layers"): "--encoder-num-layers",
    ("model", "decoder_num_layers"): "--decoder-num-layers",
    ("model", "embedding_weights_in_fp32"): "--embedding-weights-in-fp32",
    ("model", "init_method_xavier_uniform"): "--init-method-xavier-uniform",
    ("parallel", "use_ring_exchange_p2p"): "--use-ring-exchange-p2p",
    # Interleaved schedule only (dropped without it, as Megatron-LM does): p2p runs blocking.
    ("parallel", "overlap_p2p_comm"): "--overlap-p2p-communication",
    ("parallel", "standalone_embedding_stage"): "--standalone-embedding-stage",
    ("parallel", "pipeline_model_parallel_split_rank"): "--pipeline-model-parallel-split-rank",
    ("data", "retriever_seq_length"): "--retriever-seq-length",
}

_DEPRECATED = {
    ("training", "batch_size"): ("--batch-size", "--micro-batch-size"),
    ("optimizer", "warmup"): ("--warmup", "--lr-warmup-fraction"),
    ("parallel", "model_parallel_size"): ("--model-parallel-size", "--tensor-model-parallel-size"),
    ("training", "checkpoint_activations"): (
        "--checkpoint-activations", "--recompute-activations or --recompute-granularity"),
}


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
# tests/config/test_ranges.py checks that every int/float field is listed (the deprecated ones,
# refused whatever their value, excepted).
RANGES: dict[tuple[str, str], _Range] = {
    **{("model", name): _POSITIVE_INT for name in (
        "num_layers", "encoder_num_layers", "decoder_num_layers", "hidden_size",
        "ffn_hidden_size", "num_attention_heads", "kv_channels", "max_position_embeddings",
        "make_vocab_size_divisible_by", "num_experts", "num_query_groups", "rotary_base")},
    ("model", "rotary_percent"): _FRACTION,
    ("model", "layernorm_epsilon"): _POSITIVE,
    # p = 1 would scale the kept activations by 1 / (1 - p).
    ("model", "attention_dropout"): _BELOW_ONE,
    ("model", "hidden_dropout"): _BELOW_ONE,
    ("model", "seed"): _SEED,
    ("model", "init_method_std"): _POSITIVE,
    ("parallel", "tensor_model_parallel_size"): _POSITIVE_INT,
    ("parallel", "pipeline_model_parallel_size"): _POSITIVE_INT,
    ("parallel", "pipeline_model_parallel_split_rank"): _NON_NEGATIVE_INT,
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
        "seq_length", "encoder_seq_length", "decoder_seq_length", "retriever_seq_length")},
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


def validate(flags, world_size: int, require_model: bool = True,
             require_train_length: bool = False, require_data: bool = False):
    """Check the flags for a run of ``world_size`` ranks; return the final config.

    Args:
        flags: the :class:`~megatron.config.cli.MegatronConfig` as parsed (left unchanged).
        world_size: number of ranks of the run.
        require_model: the architecture flags must be present (training, evaluation).
        require_train_length: the script trains (pretrain()): --train-iters or --train-samples
            must be given unless --skip-train.
        require_data: the script reads its samples from the --data-path flags
            (pretrain_gpt.py, pretrain_bert.py): one of them, or --mock-data, must be given.

    Returns:
        A read-only copy with every derived value filled in (defaults that depend on other
        flags, the data-parallel size, the params dtype, the padded vocabulary size).

    Raises:
        ValueError: an impossible or unsupported combination, naming the flags.
    """
    cfg = copy.deepcopy(flags)
    _check_deprecated(cfg)
    _check_ranges(cfg)
    _derive_parallel_sizes(cfg, world_size)
    if require_model:
        _check_llama_features(cfg)
        _check_model_shape(cfg)
        _check_query_groups(cfg)
        _check_rotary_dims(cfg.model)
        _check_pipeline_layers(cfg)
    _check_batch(cfg)
    _check_interleaved_schedule(cfg)
    _check_precision(cfg)
    _check_schedule(cfg)
    if require_train_length:
        _check_training_run(cfg)
    if cfg.training.skip_train:
        _check_evaluates_a_checkpoint(cfg.checkpoint)
    _check_recompute(cfg)
    _check_sequence_parallel(cfg)
    _check_misc(cfg)
    _check_data(cfg)
    _check_output_directories(cfg)
    _check_tokenizer(cfg)
    if require_data:
        # After the checks of flags given: a flag given wrong is the more specific error.
        _check_data_given(cfg.data)
    _check_not_implemented(cfg)
    if require_model:
        _derive_padded_vocab_size(cfg)
    return make_read_only(cfg)


def _check_deprecated(cfg) -> None:
    for (section, name), (old, new) in _DEPRECATED.items():
        value = getattr(getattr(cfg, section), name)
        if value not in (None, False):
            raise ValueError(f"{old} is no longer supported; use {new}")


def _derive_parallel_sizes(cfg, world_size: int) -> None:
    par = cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world size ({world_size}) is not divisible by --tensor-model-parallel-size ({tp}) "
            f"x --pipeline-model-parallel-size ({pp}) = {tp * pp}; launch a multiple of "
            f"{tp * pp} processes or change the parallel sizes")
    cfg.world_size = world_size
    cfg.data_parallel_size = world_size // (tp * pp)
    if par.distributed_backend == "nccl" and not device.accelerator_available():
        raise ValueError("--distributed-backend nccl needs CUDA, which this machine lacks; "
                         "use --distributed-backend gloo")


def _check_ranges(cfg) -> None:
    """Every value set against its range in :data:`RANGES`, naming the flag as spelled."""
    for (section, name), allowed in RANGES.items():
        sec = getattr(cfg, section)
        value = getattr(sec, name)
        if value is None or value in allowed:
            continue
        field = next(f for f in dataclasses.fields(sec) if f.name == name)
        raise ValueError(f"{flag_name(field)} ({value}) must be {allowed.text}")


def _check_llama_features(cfg) -> None:
    """RoPE, the gated/squared MLPs: Megatron-LM core_v0.13's rules (runs before the shape
    check, which derives --ffn-hidden-size from --swiglu)."""
    m = cfg.model
    if m.use_rotary_position_embeddings:
        if m.position_embedding_type == "none":
            raise ValueError("--use-rotary-position-embeddings and --position-embedding-type "
                             "none contradict; drop one")
        m.position_embedding_type = "rope"  # the older spelling, as Megatron-LM maps it
    if m.position_embedding_type != "learned_absolute":
        m.add_position_embedding = False  # the learned table is learned_absolute's only
    if m.swiglu and m.squared_relu:
        raise ValueError("--swiglu and --squared-relu both choose the MLP activation; "
                         "give one")


def _default_ffn_hidden_size(m) -> int:
    """4 h, or with --swiglu two thirds of it rounded down to a multiple of 64 (Megatron-LM:
    the gated MLP's two fc1 halves then hold about the parameters of a 4 h GeLU MLP)."""
    if not m.swiglu:
        return 4 * m.hidden_size
    ffn = int((4 * m.hidden_size * 2 / 3) / 64) * 64
    if ffn == 0:
        raise ValueError(f"--swiglu with --hidden-size {m.hidden_size} gives a default "
                         "--ffn-hidden-size of 0 (int(8 h / 3 / 64) * 64); set --ffn-hidden-size")
    return ffn


def _check_query_groups(cfg) -> None:
    """--num-query-groups must split over TP ranks and divide the query heads."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    if not m.group_query_attention:
        m.num_query_groups = None  # ignored without --group-query-attention (Megatron-LM)
        return
    g = m.num_query_groups
    if g % tp != 0:
        raise ValueError(f"--num-query-groups ({g}) with --group-query-attention is not "
                         f"divisible by --tensor-model-parallel-size ({tp}): every TP rank "
                         "holds whole key/value groups; use a multiple of the TP size")
    if m.num_attention_heads % g != 0:
        raise ValueError(f"--num-attention-heads ({m.num_attention_heads}) is not divisible by "
                         f"--num-query-groups ({g}) with --group-query-attention")


def _check_rotary_dims(m) -> None:
    """RoPE turns dimension pairs: at least one pair of each head must rotate."""
    if m.position_embedding_type == "rope" and int(m.kv_channels * m.rotary_percent) < 2:
        raise ValueError(f"--rotary-percent ({m.rotary_percent}) of --kv-channels "
                         f"({m.kv_channels}) rotates fewer than 2 dimensions; raise it")


def _check_model_shape(cfg) -> None:
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    missing = [flag for flag, value in (
        ("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
        ("--num-attention-heads", m.num_attention_heads),
        ("--max-position-embeddings", m.max_position_embeddings)) if value is None]
    if missing:
        raise ValueError(f"missing required flag(s): {', '.join(missing)}")
    if m.num_attention_heads % tp != 0:
        raise ValueError(f"--num-attention-heads ({m.num_attention_heads}) is not divisible by "
                         f"--tensor-model-parallel-size ({tp})")
    if m.ffn_hidden_size is None:
        m.ffn_hidden_size = _default_ffn_hidden_size(m)
    if m.ffn_hidden_size % tp != 0:
        raise ValueError(f"--ffn-hidden-size ({m.ffn_hidden_size}) is not divisible by "
                         f"--tensor-model-parallel-size ({tp})")
    if m.kv_channels is None:
        if m.hidden_size % m.num_attention_heads != 0:
            raise ValueError(f"--hidden-size ({m.hidden_size}) is not divisible by "
                             f"--num-attention-heads ({m.num_attention_heads}); set --kv-channels")
        m.kv_channels = m.hidden_size // m.num_attention_heads
    d = cfg.data
    if d.seq_length is None:
        d.seq_length = d.encoder_seq_length
    elif d.encoder_seq_length is None:
        d.encoder_seq_length = d.seq_length
    elif d.encoder_seq_length != d.seq_length:
        raise ValueError(f"--seq-length ({d.seq_length}) and --encoder-seq-length "
                         f"({d.encoder_seq_length}) differ")
    if d.seq_length is not None and d.seq_length > m.max_position_embeddings:
        raise ValueError(f"--seq-length ({d.seq_length}) is larger than "
                         f"--max-position-embeddings ({m.max_position_embeddings})")


def _check_pipeline_layers(cfg) -> None:
    par, layers = cfg.parallel, cfg.model.num_layers
    pp = par.pipeline_model_parallel_size
    if layers % pp != 0:
        raise ValueError(f"--num-layers ({layers}) is not divisible by "
                         f"--pipeline-model-parallel-size ({pp})")
    per_virtual = par.num_layers_per_virtual_pipeline_stage
    if per_virtual is not None:
        # Megatron-LM 23.06 asks for more than two stages; its interleaved schedule (and this
        # one) also runs on two (later Megatron-LM releases allow it): README differences.
        if pp < 2:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage ({per_virtual}) "
                             "(interleaved schedule) needs --pipeline-model-parallel-size >= 2, "
                             f"got {pp}; drop the flag to run without pipelining")
        if (layers // pp) % per_virtual != 0:
            raise ValueError(
                f"--num-layers ({layers}) / --pipeline-model-parallel-size ({pp}) = "
                f"{layers // pp} layers per stage is not divisible by "
                f"--num-layers-per-virtual-pipeline-stage ({per_virtual})")
        cfg.virtual_pipeline_model_parallel_size = (layers // pp) // per_virtual
    else:
        # As Megatron-LM: p2p overlap only exists in the interleaved schedule.
        par.overlap_p2p_comm = False


def _check_batch(cfg) -> None:
    t, dp = cfg.training, cfg.data_parallel_size
    if t.micro_batch_size is None:
        t.micro_batch_size = 1 if t.global_batch_size is None else None
    if t.micro_batch_size is None or t.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be a positive integer, got {t.micro_batch_size}")
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    if t.global_batch_size % (t.micro_batch_size * dp) != 0:
        raise ValueError(
            f"--global-batch-size ({t.global_batch_size}) is not divisible by "
            f"--micro-batch-size ({t.micro_batch_size}) x data-parallel size ({dp}) = "
            f"{t.micro_batch_size * dp}")
    if t.rampup_batch_size is not None:
        _check_rampup(t, dp)
    if t.train_iters is not None and t.train_samples is not None:
        raise ValueError("--train-iters and --train-samples are mutually exclusive")


def _check_rampup(t, dp: int) -> None:
    """The ramp-up's values, as megatron.training.microbatches reads them (its calculator
    repeats the divisibility checks when built, after the process groups start)."""
    values = t.rampup_batch_size
    usage = ("--rampup-batch-size takes 3 integers: <start batch size> <batch size increment> "
             f"<ramp-up samples>, got {' '.join(values)}")
    if len(values) != 3:
        raise ValueError(usage)
    try:
        start, increment, samples = (int(v) for v in values)
    except ValueError:
        raise ValueError(usage) from None
    if start < 1 or increment < 1 or samples < 0:
        raise ValueError(f"{usage}: the batch sizes must be positive, the samples >= 0")
    step = t.micro_batch_size * dp
    for what, value in (("start", start), ("increment", increment)):
        if value % step != 0:
            raise ValueError(f"--rampup-batch-size {what} ({value}) must be a multiple of "
                             f"--micro-batch-size x data-parallel size ({step})")
    if (t.global_batch_size - start) % increment != 0:
        raise ValueError(f"--global-batch-size ({t.global_batch_size}) minus the ramp-up start "
                         f"({start}) must be a multiple of the increment ({increment})")


def _check_interleaved_schedule(cfg) -> None:
    """Megatron-LM's interleaved 1F1B schedule runs the micro-batches in groups of PP."""
    if cfg.virtual_pipeline_model_parallel_size is None or cfg.training.rampup_batch_size:
        return
    t, pp = cfg.training, cfg.parallel.pipeline_model_parallel_size
    num_microbatches = t.global_batch_size // (t.micro_batch_size * cfg.data_parallel_size)
    if num_microbatches % pp != 0:
        raise ValueError(
            f"the interleaved schedule (--num-layers-per-virtual-pipeline-stage) needs the number "
            f"of micro-batches ({num_microbatches} = --global-batch-size ({t.global_batch_size}) "
            f"/ (--micro-batch-size ({t.micro_batch_size}) x data-parallel size "
            f"({cfg.data_parallel_size}))) to be divisible by --pipeline-model-parallel-size "
            f"({pp})")


def _check_precision(cfg) -> None:
    p = cfg.precision
    if p.fp16 and p.bf16:
        raise ValueError("--fp16 and --bf16 are mutually exclusive: pick one")
    cfg.params_dtype = torch.half if p.fp16 else torch.bfloat16 if p.bf16 else torch.float32
    if p.bf16:
        # bf16 gradients lose too much precision when summed: Megatron forces fp32 accumulation.
        p.accumulate_allreduce_grads_in_fp32 = True
    if p.fp16_lm_cross_entropy and not p.fp16:
        raise ValueError("--fp16-lm-cross-entropy needs --fp16")
    if p.fp32_residual_connection and not (p.fp16 or p.bf16):
        raise ValueError("--fp32-residual-connection needs --fp16 or --bf16")
    if p.fp16 and p.loss_scale is None:
        _check_dynamic_loss_scale(p)
    if (p.accumulate_allreduce_grads_in_fp32 or cfg.parallel.use_distributed_optimizer) \
            and (cfg.parallel.ddp_impl != "local"
                 or not cfg.parallel.use_contiguous_buffers_in_local_ddp):
        raise ValueError("--accumulate-allreduce-grads-in-fp32, --bf16 and "
                         "--use-distributed-optimizer need --DDP-impl local with contiguous "
                         "buffers (drop --no-contiguous-buffers-in-local-ddp)")
    if cfg.parallel.overlap_grad_reduce and cfg.parallel.ddp_impl == "local" \
            and not cfg.parallel.use_contiguous_buffers_in_local_ddp:
        raise ValueError("--overlap-grad-reduce reduces the contiguous gradient buffer bucket by "
                         "bucket: drop --no-contiguous-buffers-in-local-ddp")


def _check_dynamic_loss_scale(p) -> None:
    # The dynamic scaler's own invariants, checked here so that a bad value fails before any
    # process group starts instead of on every rank when the optimizer is built.
    # (Each value's own range is checked in _check_ranges.)
    if p.min_loss_scale > p.initial_loss_scale:
        raise ValueError(f"--min-loss-scale ({p.min_loss_scale}) must be at most "
                         f"--initial-loss-scale ({p.initial_loss_scale})")


def _check_schedule(cfg) -> None:
    t, o = cfg.training, cfg.optimizer
    if t.train_iters is not None:
        if o.lr_decay_samples is not None or o.lr_warmup_samples:
            raise ValueError("iteration-based training (--train-iters) needs iteration-based "
                             "--lr-decay-iters / --lr-warmup-iters (or --lr-warmup-fraction), not "
                             "--lr-decay-samples / --lr-warmup-samples")
        if t.rampup_batch_size is not None:
            raise ValueError("--rampup-batch-size needs sample-based training (--train-samples)")
    if t.train_samples is not None and (o.lr_decay_iters is not None or o.lr_warmup_iters):
        raise ValueError("sample-based training (--train-samples) needs --lr-decay-samples / "
                         "--lr-warmup-samples (or --lr-warmup-fraction), not the -iters flags")
    if o.lr_warmup_fraction is not None and (o.lr_warmup_iters or o.lr_warmup_samples):
        raise ValueError("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are "
                         "mutually exclusive")
    _check_warmup_shorter_than_decay(t, o)
    if o.lr is not None and o.min_lr > o.lr:
        raise ValueError(f"--min-lr ({o.min_lr}) is larger than --lr ({o.lr})")
    if o.weight_decay_incr_style == "constant":
        if o.start_weight_decay is not None or o.end_weight_decay is not None:
            raise ValueError("--start-weight-decay/--end-weight-decay need "
                             "--weight-decay-incr-style linear or cosine")
        o.start_weight_decay = o.end_weight_decay = o.weight_decay
    elif o.start_weight_decay is None or o.end_weight_decay is None:
        raise ValueError(f"--weight-decay-incr-style {o.weight_decay_incr_style} needs "
                         "--start-weight-decay and --end-weight-decay")
    if o.override_opt_param_scheduler and o.use_checkpoint_opt_param_scheduler:
        raise ValueError("--override-opt_param-scheduler and "
                         "--use-checkpoint-opt_param-scheduler are mutually exclusive")


def _check_warmup_shorter_than_decay(t, o) -> None:
    """The LR schedule's own condition (megatron/training/lr_schedule.py), before any process
    group starts; --lr-warmup-fraction is below 1 by its range."""
    if o.lr_warmup_fraction is not None:
        return
    if t.train_iters is not None:
        warmup = ("--lr-warmup-iters", o.lr_warmup_iters)
        decay = ("--lr-decay-iters", o.lr_decay_iters) if o.lr_decay_iters is not None \
            else ("--train-iters", t.train_iters)
    elif t.train_samples is not None:
        warmup = ("--lr-warmup-samples", o.lr_warmup_samples)
        decay = ("--lr-decay-samples", o.lr_decay_samples) if o.lr_decay_samples is not None \
            else ("--train-samples", t.train_samples)
    else:
        return
    if warmup[1] >= decay[1]:
        raise ValueError(f"{warmup[0]} ({warmup[1]}) must be shorter than the learning-rate "
                         f"decay, {decay[0]} ({decay[1]})")


def _check_training_run(cfg) -> None:
    t = cfg.training
    if t.skip_train:
        # Evaluation only: the optimizer and LR schedule are never stepped, so their saved
        # state is not loaded (nor checked against the length and --lr flags, which may be left
        # out). Megatron-LM 23.06 still demanded a length here and then failed inside.
        cfg.checkpoint.no_load_optim = True
        return
    if t.train_iters is None and t.train_samples is None:
        raise ValueError("give the run's length with --train-iters or --train-samples "
                         "(or --skip-train to only evaluate)")
    if cfg.optimizer.lr is None:
        raise ValueError("--lr is required for training")


def _check_evaluates_a_checkpoint(ck) -> None:
    """--skip-train evaluates the --load checkpoint: a missing one must not pass for a model
    (random weights give a plausible-looking validation loss); --random-weights asks for that."""
    if ck.random_weights:
        if ck.load is not None:
            raise ValueError(f"--random-weights and --load {ck.load} are mutually exclusive: "
                             "drop --random-weights to evaluate the checkpoint")
        return
    if ck.load is None:
        raise ValueError("--skip-train evaluates a checkpoint: give --load (or --random-weights "
                         "to evaluate untrained weights on purpose)")
    ck.exit_on_missing_checkpoint = True  # a --load holding none is refused when loading


def _check_recompute(cfg) -> None:
    t, tp = cfg.training, cfg.parallel.tensor_model_parallel_size
    if t.recompute_activations:
        t.recompute_granularity = "selective"
    if t.recompute_granularity == "selective" and t.recompute_method is not None:
        raise ValueError("--recompute-method applies to --recompute-granularity full only")
    if t.recompute_granularity == "full" and t.recompute_method is None:
        raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
    if t.distribute_saved_activations and (tp == 1 or t.recompute_granularity != "full"):
        raise ValueError("--distribute-saved-activations needs --tensor-model-parallel-size > 1 "
                         "and --recompute-granularity full")


def _check_sequence_parallel(cfg) -> None:
    """Megatron-LM (23.06 and core_v0.13 alike) switches --sequence-parallel off without tensor
    parallelism, where it would change nothing but the numerics; it warns (core_v0.13)."""
    par = cfg.parallel
    if not par.sequence_parallel:
        return
    tp = par.tensor_model_parallel_size
    if tp == 1:
        warnings.warn("--sequence-parallel is disabled: it needs --tensor-model-parallel-size "
                      "> 1 (Megatron-LM disables it too)", stacklevel=2)
        par.sequence_parallel = False
        return
    seq = cfg.data.seq_length
    if seq is not None and seq % tp != 0:
        raise ValueError(f"--sequence-parallel splits the sequence over the tensor-parallel "
                         f"ranks: --seq-length ({seq}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp})")


def _check_misc(cfg) -> None:
    ck, d = cfg.checkpoint, cfg.data
    if ck.save is not None and ck.save_interval is None:
        raise ValueError("--save needs --save-interval")
    if d.dataloader_type is None:
        d.dataloader_type = "single"
    if d.reset_attention_mask and not d.create_attention_mask_in_dataloader:
        raise ValueError("--reset-attention-mask needs the per-sample attention mask: drop "
                         "--no-create-attention-mask-in-dataloader")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_data(cfg) -> None:
    """--split, the dataset prefixes and their combination, as the dataset builders read them
    (megatron.data.utils), but before any process group starts."""
    from megatron.data.indexed_dataset import data_file_path, index_file_path
    from megatron.data.utils import get_blend_from_list, parse_and_normalize_split

    d = cfg.data
    parse_and_normalize_split(d.split)  # ValueError naming --split and its value
    per_split = {f"--{name}-data-path": getattr(d, f"{name}_data_path")
                 for name in ("train", "valid", "test")}
    given = [flag for flag, paths in per_split.items() if paths]
    if d.data_path and given:
        raise ValueError(f"--data-path cannot be combined with {'/'.join(given)}: use --data-path "
                         "with --split, or per-split paths")
    for flag, paths in {"--data-path": d.data_path, **per_split}.items():
        if not paths:
            continue
        if len(paths) % 2 == 1 and any(_is_number(p) for p in paths):
            raise ValueError(f"{flag} {' '.join(paths)}: {len(paths)} values with numeric "
                             "weights; give 'weight prefix' pairs, e.g. 0.3 a 0.7 b")
        prefixes, _ = get_blend_from_list(paths, flag)
        if d.mock_data:
            continue  # --mock-data ignores the paths
        for prefix in prefixes:
            missing = [path for path in (data_file_path(prefix), index_file_path(prefix))
                       if not os.path.isfile(path)]
            if missing:
                raise ValueError(f"{flag}: no dataset at prefix {prefix!r} "
                                 f"({' and '.join(missing)} not found; give the path without "
                                 ".bin/.idx)")


def _check_data_given(d) -> None:
    if d.mock_data or d.data_path or d.train_data_path or d.valid_data_path or d.test_data_path:
        return
    raise ValueError("no data: give --data-path (split by --split), or --train-data-path / "
                     "--valid-data-path / --test-data-path, or --mock-data for synthetic samples")


def _not_a_directory(path: str) -> str | None:
    """Why ``path`` cannot be (or become) a writable directory, else None.

    Its nearest existing ancestor decides (``mkdir -p`` starts there): a regular file on the
    way fails only when the first file is written, after the model is built and trained.
    """
    existing = os.path.abspath(path)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a regular file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user"
    return None


def _check_output_directories(cfg) -> None:
    """Directories the run writes into can be created there (before any process group)."""
    for flag, path in (("--save", cfg.checkpoint.save),
                       ("--tensorboard-dir", cfg.logging.tensorboard_dir),
                       ("--data-cache-path", cfg.data.data_cache_path)):
        problem = None if path is None else _not_a_directory(path)
        if problem is not None:
            raise ValueError(f"{flag} {path}: {problem}; give {flag} a directory this run can "
                             "create or write to")


def _check_tokenizer(cfg) -> None:
    """Every file (or size) the --tokenizer-type needs is given, and the files exist."""
    from megatron.tokenizer.config import REQUIRED_FIELDS  # the builder's table: both agree

    tok = cfg.tokenizer
    if tok.tokenizer_type is None:
        return
    for name in REQUIRED_FIELDS.get(tok.tokenizer_type, ()):
        flag, value = "--" + name.replace("_", "-"), getattr(tok, name)
        if value is None:
            raise ValueError(f"--tokenizer-type {tok.tokenizer_type} needs {flag}")
        if name != "vocab_size" and not os.path.exists(value):
            raise ValueError(f"{flag} {value}: no such file (needed by --tokenizer-type "
                             f"{tok.tokenizer_type})")


def _derive_padded_vocab_size(cfg) -> None:
    """The embedding size the model is built with: the tokenizer's vocabulary padded to a
    multiple of --make-vocab-size-divisible-by x TP (--mock-data without a tokenizer uses a
    NullTokenizer of --vocab-size, default GPT-2's 50257)."""
    from megatron.tokenizer import create_tokenizer, vocab_size_with_padding

    tok = cfg.tokenizer
    if tok.tokenizer_type is None and cfg.data.mock_data:
        tok.tokenizer_type = "NullTokenizer"
        tok.vocab_size = tok.vocab_size or 50257
    if tok.tokenizer_type is None:
        return
    vocab_size = create_tokenizer(tok).vocab_size
    saved = cfg.padded_vocab_size if cfg.checkpoint.use_checkpoint_args else None
    if saved is not None:  # --use-checkpoint-args: the checkpoint's embedding size wins
        tp = cfg.parallel.tensor_model_parallel_size
        if saved < vocab_size or saved % tp:
            raise ValueError(f"--use-checkpoint-args: the checkpoint's padded vocabulary "
                             f"({saved}) must hold the tokenizer's {vocab_size} tokens and split "
                             f"over --tensor-model-parallel-size {tp}; re-pad it with "
                             "tools/checkpoint/convert.py --target-vocab-size-divisible-by")
        cfg.padded_vocab_size = saved
        return
    cfg.padded_vocab_size = vocab_size_with_padding(
        vocab_size, cfg.model.make_vocab_size_divisible_by,
        cfg.parallel.tensor_model_parallel_size)


def _check_pipeline_not_implemented(cfg) -> None:
    """Pipeline combinations Megatron-LM runs and this framework does not (yet)."""
    par, pp = cfg.parallel, cfg.parallel.pipeline_model_parallel_size
    if pp > 1 and par.overlap_grad_reduce and par.use_distributed_optimizer \
            and not cfg.model.untie_embeddings_and_output_weights:
        raise ValueError(
            f"--pipeline-model-parallel-size {pp} with tied embeddings, --overlap-grad-reduce "
            "and --use-distributed-optimizer: the two stages' embedding gradients would be "
            "summed after each was reduce-scattered over a different shard layout; drop "
            "--overlap-grad-reduce, or pass --untie-embeddings-and-output-weights")


BERT_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase")
"""Tokenizers with the [CLS]/[SEP]/[MASK]/[PAD] tokens BERT samples are made of."""

# GPT-dataset flags that BERT's samples (sentence pairs with a padding mask) never read.
_GPT_ONLY_DATA_FLAGS = {"reset_position_ids": "--reset-position-ids",
                        "reset_attention_mask": "--reset-attention-mask",
                        "eod_mask_loss": "--eod-mask-loss"}


def check_bert_flags(cfg) -> None:
    """pretrain_bert.py's flag checks, on the parsed flags before pretrain() validates the rest
    (no process group exists yet).

    Raises:
        ValueError: a flag BERT cannot honour, naming it and the fix.
    """
    if cfg.model.untie_embeddings_and_output_weights:
        raise ValueError("--untie-embeddings-and-output-weights: BERT's LM head is tied to the "
                         "word embeddings (Megatron-LM refuses it too); drop the flag")
    for name, flag in _GPT_ONLY_DATA_FLAGS.items():
        if getattr(cfg.data, name):
            raise ValueError(f"{flag} is a GPT dataset flag; BERT samples are sentence pairs "
                             "with a padding mask: drop it")
    tok = cfg.tokenizer.tokenizer_type
    if tok is not None and tok not in BERT_TOKENIZERS and not cfg.data.mock_data:
        raise ValueError(f"--tokenizer-type {tok}: BERT needs a WordPiece vocabulary with "
                         f"[CLS], [SEP], [MASK] and [PAD]: use --tokenizer-type "
                         f"{' or '.join(BERT_TOKENIZERS)} with --vocab-file")


def _check_not_implemented(cfg) -> None:
    for (section, name), flag in NOT_IMPLEMENTED.items():
        sec = getattr(cfg, section)
        default = {f.name: f.default for f in dataclasses.fields(sec)}[name]
        if getattr(sec, name) != default:
            raise ValueError(f"{flag} is a Megatron-LM flag this framework does not implement yet")
    _check_pipeline_not_implemented(cfg)
    if cfg.model.transformer_impl != "local":
        raise ValueError("--transformer-impl transformer_engine needs NVIDIA Transformer Engine, "
                         "which this framework does not use; use --transformer-impl local")
