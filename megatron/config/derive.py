"""The values validate() derives: defaults that depend on other flags, and the sizes and dtype
the layers read (``cfg.data_parallel_size``, ``cfg.params_dtype``, ...).

All of them are computed here, in one pass after the range checks and before the combination
checks (megatron.config.validate), so that the checks only read. A derivation never raises:
where its inputs are missing or inconsistent it leaves the value unset, and the check that
follows names the flag and the fix. The one exception runs after the checks:
:func:`derive_padded_vocab_size` builds the tokenizer, from the files the checks have vetted.
"""

from __future__ import annotations

import warnings

import torch

# --mock-data without --tokenizer-type: a NullTokenizer of GPT-2's vocabulary size.
_NULL_TOKENIZER_VOCAB_SIZE = 50257


def derive(cfg, world_size: int, *, require_model: bool, require_train_length: bool) -> None:
    """Fill in ``cfg``'s derived values (a private copy: validate() deep-copies the flags)."""
    derive_parallel_sizes(cfg, world_size)
    if require_model:
        _derive_model_shape(cfg)
        derive_pipeline_layers(cfg)
        _derive_null_tokenizer(cfg)
    _derive_batch(cfg)
    _derive_precision(cfg)
    _derive_weight_decay(cfg)
    _derive_checkpoint_use(cfg, require_train_length)
    _derive_sequence_parallel(cfg)
    if cfg.training.recompute_activations:
        # Megatron-LM's --recompute-activations is the selective recomputation.
        cfg.training.recompute_granularity = "selective"
    if cfg.data.dataloader_type is None:
        cfg.data.dataloader_type = "single"


def _derive_sequence_parallel(cfg) -> None:
    """Megatron-LM (23.06 and core_v0.13 alike) switches --sequence-parallel off without tensor
    parallelism, where it would change nothing but the numerics; it warns (core_v0.13)."""
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor_model_parallel_size == 1:
        warnings.warn("--sequence-parallel is disabled: it needs --tensor-model-parallel-size "
                      "> 1 (Megatron-LM disables it too)", stacklevel=3)
        cfg.parallel.sequence_parallel = False


def derive_parallel_sizes(cfg, world_size: int) -> None:
    par = cfg.parallel
    # Context-parallel ranks hold one replica's sequence pieces: not data-parallel ranks.
    model_parallel = (par.tensor_model_parallel_size * par.pipeline_model_parallel_size
                      * par.context_parallel_size)
    cfg.world_size = world_size
    if world_size % model_parallel == 0:
        cfg.data_parallel_size = world_size // model_parallel
    # Megatron-LM's help text spells it allgather, Transformer Engine all_gather: read one.
    par.cp_comm_type = ["all_gather" if t == "allgather" else t for t in par.cp_comm_type]


def _derive_llama_features(m) -> None:
    """RoPE's older spelling, the learned position table only for learned_absolute, and the
    query groups only with --group-query-attention (Megatron-LM core_v0.13's rules)."""
    if m.use_rotary_position_embeddings and m.position_embedding_type != "none":
        m.position_embedding_type = "rope"  # the older spelling, as Megatron-LM maps it
    if m.position_embedding_type != "learned_absolute":
        m.add_position_embedding = False  # the learned table is learned_absolute's only
    if not m.group_query_attention:
        m.num_query_groups = None  # ignored without --group-query-attention (Megatron-LM)


def _default_ffn_hidden_size(m) -> int | None:
    """4 h, or with --swiglu two thirds of it rounded down to a multiple of 64 (Megatron-LM:
    the gated MLP's two fc1 halves then hold about the parameters of a 4 h GeLU MLP); None
    where that is 0 (the check names --ffn-hidden-size)."""
    if not m.swiglu:
        return 4 * m.hidden_size
    return int((4 * m.hidden_size * 2 / 3) / 64) * 64 or None


def _derive_model_shape(cfg) -> None:
    m, d = cfg.model, cfg.data
    _derive_llama_features(m)
    if m.ffn_hidden_size is None and m.hidden_size is not None:
        m.ffn_hidden_size = _default_ffn_hidden_size(m)
    if m.kv_channels is None and m.hidden_size is not None and m.num_attention_heads \
            and m.hidden_size % m.num_attention_heads == 0:
        m.kv_channels = m.hidden_size // m.num_attention_heads
    # --seq-length and --encoder-seq-length are one value; either may be given.
    if d.seq_length is None:
        d.seq_length = d.encoder_seq_length
    elif d.encoder_seq_length is None:
        d.encoder_seq_length = d.seq_length


def derive_pipeline_layers(cfg) -> None:
    """The virtual pipeline size of the interleaved schedule (when the layers split evenly)."""
    par, layers = cfg.parallel, cfg.model.num_layers
    pp, per_virtual = par.pipeline_model_parallel_size, par.num_layers_per_virtual_pipeline_stage
    if per_virtual is None:
        # As Megatron-LM: p2p overlap only exists in the interleaved schedule.
        par.overlap_p2p_comm = False
    elif layers is not None and pp >= 2 and layers % pp == 0 and (layers // pp) % per_virtual == 0:
        cfg.virtual_pipeline_model_parallel_size = (layers // pp) // per_virtual


def _derive_null_tokenizer(cfg) -> None:
    tok = cfg.tokenizer
    if tok.tokenizer_type is None and cfg.data.mock_data:
        tok.tokenizer_type = "NullTokenizer"
        tok.vocab_size = tok.vocab_size or _NULL_TOKENIZER_VOCAB_SIZE


def _derive_batch(cfg) -> None:
    t = cfg.training
    if t.micro_batch_size is None and t.global_batch_size is None:
        t.micro_batch_size = 1
    if t.global_batch_size is None and t.micro_batch_size is not None:
        # One micro-batch per data-parallel rank: no gradient accumulation.
        t.global_batch_size = t.micro_batch_size * cfg.data_parallel_size


def _derive_precision(cfg) -> None:
    p = cfg.precision
    cfg.params_dtype = torch.half if p.fp16 else torch.bfloat16 if p.bf16 else torch.float32
    if p.bf16:
        # bf16 gradients lose too much precision when summed: Megatron forces fp32 accumulation.
        p.accumulate_allreduce_grads_in_fp32 = True


def _derive_weight_decay(cfg) -> None:
    o = cfg.optimizer
    if o.weight_decay_incr_style == "constant" \
            and o.start_weight_decay is None and o.end_weight_decay is None:
        o.start_weight_decay = o.end_weight_decay = o.weight_decay


def _derive_checkpoint_use(cfg, require_train_length: bool) -> None:
    ck, t = cfg.checkpoint, cfg.training
    if require_train_length and t.skip_train:
        # Evaluation only: the optimizer and LR schedule are never stepped, so their saved
        # state is not loaded (nor checked against the length and --lr flags, which may be left
        # out). Megatron-LM 23.06 still demanded a length here and then failed inside.
        ck.no_load_optim = True
    if t.skip_train and not ck.random_weights and ck.load is not None:
        # --skip-train evaluates the --load checkpoint: a --load holding none is refused when
        # loading (random weights give a plausible-looking validation loss).
        ck.exit_on_missing_checkpoint = True


def derive_padded_vocab_size(cfg) -> None:
    """The embedding size the model is built with: the tokenizer's vocabulary padded to a
    multiple of --make-vocab-size-divisible-by x TP. Runs after the checks (it reads the
    tokenizer's files); raises when --use-checkpoint-args brings a size that cannot hold it."""
    from megatron.tokenizer import create_tokenizer, vocab_size_with_padding

    tok = cfg.tokenizer
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
