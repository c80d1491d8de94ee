"""The one place where flag combinations are checked, before any process group starts (so a
bad flag costs a second, not a rendezvous and a model build).

validate() runs, in this order: the refusals of deprecated flags and the ranges of numeric
flags (the values as given: the derivations divide by them); every derived value
(megatron.config.derive, which never raises); the checks of combinations below, which only
read; the refusals of flags not built (megatron.config.refusals); last the padded vocabulary,
built from the tokenizer files the checks vetted. Every error is a ``ValueError`` whose message
names the flags involved, the offending value or path, and what to change.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence

from megatron.config.base import make_read_only
from megatron.config.derive import (derive, derive_padded_vocab_size, derive_parallel_sizes,
                                    derive_pipeline_layers)
from megatron.config.moe_checks import check_moe, derive_moe
from megatron.config.ranges import RANGES, check_ranges
from megatron.config.refusals import (_DEPRECATED, NOT_IMPLEMENTED, check_deprecated,
                                      check_not_implemented)
from megatron.core import device
from megatron.tokenizer.config import BERT_TOKENIZERS

__all__ = ["validate", "ToolChecks", "ToolFlagError", "check_bert_flags",
           "refuse_context_parallel", "RANGES",
           "NOT_IMPLEMENTED", "_DEPRECATED"]

# The names tests/config reach in for (ranges and refusals live in their own modules).
_check_ranges, _derive_parallel_sizes, _derive_pipeline_layers = (
    check_ranges, derive_parallel_sizes, derive_pipeline_layers)


@dataclasses.dataclass(frozen=True)
class ToolChecks:
    """A tool's or task's own flag checks (its flag section's, and its refusals of framework
    flags), registered with validate() so that they run there, before any process group starts.

    Each is called with the config and only reads it; a user error raises ``ValueError``.
    """

    given: Sequence[Callable] = ()
    """Run on the flags as parsed, before the framework's checks (a tool's flag given wrong is
    the more specific error)."""
    validated: Sequence[Callable] = ()
    """Run on the validated, read-only config (derived values such as the data-parallel size,
    or a --use-checkpoint-args value), after the framework's checks."""


class ToolFlagError(ValueError):
    """A :class:`ToolChecks` error: the tools report it on one line, without the usage."""


def _run_tool_checks(checks: Sequence[Callable], cfg) -> None:
    for check in checks:
        try:
            check(cfg)
        except ToolFlagError:
            raise
        except ValueError as err:
            raise ToolFlagError(str(err)) from err


def validate(flags, world_size: int, require_model: bool = True,
             require_train_length: bool = False, require_data: bool = False,
             tool_checks: ToolChecks = ToolChecks()):
    """Check the flags for a run of ``world_size`` ranks; return the final config.

    Args:
        flags: the :class:`~megatron.config.cli.MegatronConfig` as parsed (left unchanged).
        world_size: number of ranks of the run.
        require_model: the architecture flags must be present (training, evaluation).
        require_train_length: the script trains (pretrain()): --train-iters or --train-samples
            must be given unless --skip-train.
        require_data: the script reads its samples from the --data-path flags
            (pretrain_gpt.py, pretrain_bert.py): one of them, or --mock-data, must be given.
        tool_checks: the running tool's own checks, run first and last.

    Returns:
        A read-only copy with every derived value filled in (defaults that depend on other
        flags, the data-parallel size, the params dtype, the padded vocabulary size).

    Raises:
        ValueError: an impossible or unsupported combination, naming the flags
            (:class:`ToolFlagError` from ``tool_checks``).
    """
    _run_tool_checks(tool_checks.given, flags)
    cfg = copy.deepcopy(flags)
    check_deprecated(cfg)
    check_ranges(cfg)
    if require_model:
        # On the flags as given: derive() drops what they ignore (num_query_groups...).
        _check_position_embedding_given(cfg)
        _warn_on_ignored_model_flags(cfg)
    derive(cfg, world_size, require_model=require_model,
           require_train_length=require_train_length)
    derive_moe(cfg)
    # The checks keep the order they had when each one derived its own values: with several
    # errors, the first one reported stays the same.
    _check_parallel_sizes(cfg, world_size)
    _check_context_parallel(cfg)
    check_moe(cfg, world_size)
    if require_model:
        _check_llama_features(cfg.model)
        _check_model_shape(cfg)
        _check_query_groups(cfg)
        _check_qk_norm_span(cfg)
        _check_rotary_dims(cfg)
        _check_pipeline_layers(cfg)
    _check_batch(cfg)
    _check_interleaved_schedule(cfg)
    _check_precision(cfg)
    _check_schedule(cfg, given=flags.optimizer)
    if require_train_length:
        _check_training_run(cfg)
    if cfg.training.skip_train:
        _check_evaluates_a_checkpoint(cfg.checkpoint)
    _check_recompute(cfg)
    _check_sequence_parallel(cfg)
    _check_compile_layers(cfg)
    _check_misc(cfg)
    _check_checkpoint_format(cfg)
    _check_data(cfg)
    _check_output_directories(cfg)
    _check_tokenizer(cfg)
    if require_data:
        # After the checks of flags given: a flag given wrong is the more specific error.
        _check_data_given(cfg.data)
    check_not_implemented(cfg)
    if require_model:
        derive_padded_vocab_size(cfg)
    cfg = make_read_only(cfg)
    _run_tool_checks(tool_checks.validated, cfg)
    return cfg


def _check_parallel_sizes(cfg, world_size: int) -> None:
    par = cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    cp = par.context_parallel_size
    if world_size % (tp * pp * cp) != 0:
        with_cp = f" x --context-parallel-size ({cp})" if cp > 1 else ""
        raise ValueError(
            f"world size ({world_size}) is not divisible by --tensor-model-parallel-size ({tp}) "
            f"x --pipeline-model-parallel-size ({pp}){with_cp} = {tp * pp * cp}; launch a "
            f"multiple of {tp * pp * cp} processes or change the parallel sizes")
    if par.distributed_backend == "nccl" and not device.accelerator_available():
        raise ValueError("--distributed-backend nccl needs CUDA, which this machine lacks; "
                         "use --distributed-backend gloo")


CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


def _check_context_parallel(cfg) -> None:
    """--context-parallel-size: the sequence splits into 2 CP chunks; what is not built with it
    is refused by name."""
    par, cp = cfg.parallel, cfg.parallel.context_parallel_size
    types = par.cp_comm_type
    for t in types:
        if t not in CP_COMM_TYPES:
            extra = " (hierarchical context parallelism is not built)" if t == "a2a+p2p" else ""
            raise ValueError(f"--cp-comm-type {t}{extra}: use one of "
                             f"{', '.join(CP_COMM_TYPES)}")
    layers = cfg.model.num_layers
    if len(types) > 1 and layers is not None and len(types) != layers:
        raise ValueError(f"--cp-comm-type gives {len(types)} values for --num-layers {layers}: "
                         "give one value for every layer, or a single value")
    if cp == 1:
        return
    seq = cfg.data.seq_length
    if seq is not None and seq % (2 * cp) != 0:
        raise ValueError(f"--seq-length ({seq}) must be a multiple of 2 x "
                         f"--context-parallel-size ({2 * cp}): each rank holds two of the "
                         f"{2 * cp} chunks of every sequence")
    m = cfg.model
    refused = [("--reset-attention-mask", cfg.data.reset_attention_mask,
                "packed documents need a per-document mask across the split sequence"),
               ("--attention-dropout > 0", (m.attention_dropout or 0) > 0,
                "the blockwise attention has no dropout; pass --attention-dropout 0")]
    for flag, given, why in refused:
        if given:
            raise ValueError(f"{flag} with --context-parallel-size {cp} is not supported: {why}")
    if "a2a" in types and m.num_attention_heads is not None:
        tp = par.tensor_model_parallel_size
        heads = m.num_attention_heads // tp
        groups = (m.num_query_groups or m.num_attention_heads) // tp
        if heads % cp or groups % cp:
            raise ValueError(f"--cp-comm-type a2a splits each TP rank's {heads} query heads and "
                             f"{groups} key/value heads over --context-parallel-size {cp}: both "
                             "must be divisible by it; use p2p or all_gather")


def refuse_context_parallel(what: str) -> Callable:
    """A tool check: ``what`` runs on whole sequences only (--context-parallel-size 1)."""

    def check(cfg) -> None:
        cp = cfg.parallel.context_parallel_size
        if cp != 1:
            raise ValueError(f"--context-parallel-size {cp}: {what} runs at context-parallel "
                             "size 1; drop the flag (checkpoints load at any CP size)")
    return check


def _check_llama_features(m) -> None:
    """RoPE and the gated/squared MLPs: Megatron-LM core_v0.13's rules."""
    if m.use_rotary_position_embeddings and m.position_embedding_type == "none":
        raise ValueError("--use-rotary-position-embeddings and --position-embedding-type "
                         "none contradict; drop one")
    if m.swiglu and m.squared_relu:
        raise ValueError("--swiglu and --squared-relu both choose the MLP activation; "
                         "give one")
    if m.swiglu and m.ffn_hidden_size is None and m.hidden_size is not None:
        raise ValueError(f"--swiglu with --hidden-size {m.hidden_size} gives a default "
                         "--ffn-hidden-size of 0 (int(8 h / 3 / 64) * 64); set --ffn-hidden-size")


def _check_query_groups(cfg) -> None:
    """--num-query-groups must split over TP ranks and divide the query heads."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    if not m.group_query_attention:
        return
    g = m.num_query_groups
    if g % tp != 0:
        raise ValueError(f"--num-query-groups ({g}) with --group-query-attention is not "
                         f"divisible by --tensor-model-parallel-size ({tp}): every TP rank "
                         "holds whole key/value groups; use a multiple of the TP size")
    if m.num_attention_heads % g != 0:
        raise ValueError(f"--num-attention-heads ({m.num_attention_heads}) is not divisible by "
                         f"--num-query-groups ({g}) with --group-query-attention")


def _check_qk_norm_span(cfg) -> None:
    """--qk-layernorm-full-projection: the norm over all heads sees every head only at TP=1."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    if not m.qk_layernorm_full_projection:
        return
    if not m.qk_layernorm:
        raise ValueError("--qk-layernorm-full-projection without --qk-layernorm: it says what "
                         "the q/k norms span; add --qk-layernorm")
    if tp > 1:
        raise ValueError(f"--qk-layernorm-full-projection with --tensor-model-parallel-size "
                         f"{tp}: the norm over all heads would need every TP rank's heads; "
                         "use --tensor-model-parallel-size 1")


def _check_rotary_dims(cfg) -> None:
    """RoPE turns dimension pairs: at least one pair of each head must rotate, and the rotated
    dimensions int(--kv-channels x --rotary-percent) must pair up (an odd count fails in the
    first forward pass)."""
    m = cfg.model
    if m.position_embedding_type != "rope" or m.kv_channels is None:
        return
    rotated = int(m.kv_channels * m.rotary_percent)
    default = "" if "kv_channels" in cfg.given else \
        " (--kv-channels defaults to --hidden-size / --num-attention-heads)"
    if rotated < 2:
        raise ValueError(f"--rotary-percent ({m.rotary_percent}) of --kv-channels "
                         f"({m.kv_channels}) rotates fewer than 2 dimensions; raise it{default}")
    if rotated % 2:
        raise ValueError(f"RoPE rotates int(--kv-channels ({m.kv_channels}) x --rotary-percent "
                         f"({m.rotary_percent})) = {rotated} dimensions per head, an odd number: "
                         f"it turns dimension pairs; choose values giving an even "
                         f"count{default}")


def _check_position_embedding_given(cfg) -> None:
    """--use-rotary-position-embeddings against an explicit other --position-embedding-type
    (Megatron-LM lets the older flag silently win)."""
    m = cfg.model
    if m.use_rotary_position_embeddings and "position_embedding_type" in cfg.given and \
            m.position_embedding_type == "learned_absolute":
        raise ValueError("--use-rotary-position-embeddings and --position-embedding-type "
                         "learned_absolute contradict; drop one (the first is the older "
                         "spelling of --position-embedding-type rope)")


def _warn_on_ignored_model_flags(cfg) -> None:
    """Flags given that the model they describe does not read (Megatron-LM ignores them as
    well, silently)."""
    m, given = cfg.model, cfg.given
    rope = m.position_embedding_type == "rope" or m.use_rotary_position_embeddings
    ignored = []
    if not rope:
        ignored += [(cfg.flag(name, "--" + name.replace("_", "-")),
                     "without --position-embedding-type rope")
                    for name in ("rotary_interleaved", "rotary_percent", "rotary_base")
                    if name in given]
    if m.openai_gelu and m.swiglu:
        ignored.append(("--openai-gelu", "with --swiglu (the MLP is SiLU-gated)"))
    if "num_query_groups" in given and not m.group_query_attention:
        ignored.append(("--num-query-groups", "without --group-query-attention (plain "
                                              "multi-head attention is trained)"))
    for flag, why in ignored:
        warnings.warn(f"{flag} is ignored {why}", stacklevel=3)


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
    if m.ffn_hidden_size % tp != 0:
        raise ValueError(f"--ffn-hidden-size ({m.ffn_hidden_size}) is not divisible by "
                         f"--tensor-model-parallel-size ({tp})")
    if m.kv_channels is None:  # not derived: the heads do not split the hidden size
        raise ValueError(f"--hidden-size ({m.hidden_size}) is not divisible by "
                         f"--num-attention-heads ({m.num_attention_heads}); set --kv-channels")
    d = cfg.data
    if d.encoder_seq_length != d.seq_length:
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
        # one) also runs on two (later Megatron-LM releases allow it): docs/compatibility.md.
        if pp < 2:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage ({per_virtual}) "
                             "(interleaved schedule) needs --pipeline-model-parallel-size >= 2, "
                             f"got {pp}; drop the flag to run without pipelining")
        if (layers // pp) % per_virtual != 0:
            raise ValueError(
                f"--num-layers ({layers}) / --pipeline-model-parallel-size ({pp}) = "
                f"{layers // pp} layers per stage is not divisible by "
                f"--num-layers-per-virtual-pipeline-stage ({per_virtual})")


def _check_batch(cfg) -> None:
    t, dp = cfg.training, cfg.data_parallel_size
    if t.micro_batch_size is None or t.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be a positive integer, got {t.micro_batch_size}")
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
    if p.fp16_lm_cross_entropy and not p.fp16:
        raise ValueError("--fp16-lm-cross-entropy needs --fp16")
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


def _check_schedule(cfg, given) -> None:
    """``given``: the optimizer flags as parsed (the derived weight decays hide whether the
    start and end ones were given)."""
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
        if given.start_weight_decay is not None or given.end_weight_decay is not None:
            raise ValueError("--start-weight-decay/--end-weight-decay need "
                             "--weight-decay-incr-style linear or cosine")
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
        return  # evaluation only: no length nor --lr needed (the optimizer is not loaded)
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


def _check_recompute(cfg) -> None:
    t, tp = cfg.training, cfg.parallel.tensor_model_parallel_size
    if t.recompute_granularity == "selective" and t.recompute_method is not None:
        raise ValueError("--recompute-method applies to --recompute-granularity full only")
    if t.recompute_granularity == "full" and t.recompute_method is None:
        raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
    if t.distribute_saved_activations and (tp == 1 or t.recompute_granularity != "full"):
        raise ValueError("--distribute-saved-activations needs --tensor-model-parallel-size > 1 "
                         "and --recompute-granularity full")


def _check_sequence_parallel(cfg) -> None:
    """The sequence splits evenly over the TP ranks (TP=1 switched it off: derive.py)."""
    par = cfg.parallel
    if not par.sequence_parallel:
        return
    tp = par.tensor_model_parallel_size
    seq = cfg.data.seq_length
    if seq is not None and seq % tp != 0:
        raise ValueError(f"--sequence-parallel splits the sequence over the tensor-parallel "
                         f"ranks: --seq-length ({seq}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp})")


def _check_compile_layers(cfg) -> None:
    """--compile-layers runs with every parallelism (TP, PP, DP, sequence parallelism), either
    recompute, and fp32/bf16/fp16. Its one refusal: query-key layer scaling on the unfused
    attention path gives each layer its own constant (1 / layer number), so every layer would
    compile on its own, and past torch's recompile limit (8) the rest would run uncompiled."""
    m = cfg.model
    if m.compile_layers and m.apply_query_key_layer_scaling \
            and m.attention_backend in ("unfused", "local"):
        raise ValueError("--compile-layers with --apply-query-key-layer-scaling and "
                         f"--attention-backend {m.attention_backend}: each layer's own scaling "
                         "constant would compile every layer separately; drop one of them "
                         "(SDPA, the default backend, computes in fp32 without the scaling)")


def _check_misc(cfg) -> None:
    ck, d = cfg.checkpoint, cfg.data
    if ck.save is not None and ck.save_interval is None:
        raise ValueError("--save needs --save-interval")
    if d.reset_attention_mask and not d.create_attention_mask_in_dataloader:
        raise ValueError("--reset-attention-mask needs the per-sample attention mask: drop "
                         "--no-create-attention-mask-in-dataloader")


def _check_checkpoint_format(cfg) -> None:
    """Options of the torch_dist format need it."""
    ck = cfg.checkpoint
    if ck.async_save and ck.ckpt_format != "torch_dist":
        raise ValueError("--async-save needs --ckpt-format torch_dist (the torch format writes "
                         "synchronously)")


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
    refuse_context_parallel("BERT (bidirectional attention with a padding mask)")(cfg)
    ck = cfg.checkpoint
    if (ck.ckpt_format == "torch_dist" and (ck.save is not None or ck.load is not None)
            and cfg.model.num_experts):
        raise ValueError("--ckpt-format torch_dist with BERT and --num-experts: the torch_dist "
                         "key table names BERT's dense layers only; use --ckpt-format torch")
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
