"""Does a checkpoint fit the run loading it? The architecture and parallel args compared at load,
and the hints that say how to make them agree (the padded-vocabulary divisor search, the GeLU
form, a Mistral-style sliding window).

Works on the ``args`` Namespace a checkpoint stores and the run's ``MegatronConfig``; reading the
files and the ranks stay in ``megatron.training.checkpointing``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron.checkpointing.errors import CheckpointError
from megatron.core.log import warn_rank_0
from megatron.core.transformer.config import gelu_tanh_approximation

# Architecture flags that must agree between a checkpoint and the run loading it (the RoPE ones
# only between two RoPE models: see _built).
ARCHITECTURE_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                      "kv_channels", "max_position_embeddings", "add_position_embedding",
                      "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type",
                      "untie_embeddings_and_output_weights", "add_bias_linear",
                      "position_embedding_type", "rotary_percent", "rotary_interleaved",
                      "normalization", "swiglu", "squared_relu", "num_query_groups",
                      "add_qkv_bias", "qk_layernorm", "qk_layernorm_full_projection",
                      "apply_layernorm_1p", "rotary_base",
                      "apply_residual_connection_post_layernorm", "num_experts",
                      "moe_ffn_hidden_size", "moe_layer_freq",
                      "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                      "moe_router_enable_expert_bias")
PARALLEL_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size")
CONVERTER = "tools/checkpoint/convert.py"
"""The tool that re-splits a checkpoint for other TP/PP sizes (named in mismatch errors)."""


def check_compatible(ckpt_args: argparse.Namespace | None, cfg, path: Path,
                     any_layout: bool = False) -> None:
    """Refuse a checkpoint whose saved args describe another model or another TP/PP split
    than ``cfg``; warn where it loads but computes something else (the GeLU form).

    Args:
        ckpt_args: the checkpoint's ``args`` (None: not recorded, only warned about).
        cfg: the run's ``MegatronConfig``.
        path: the shard read, named in the messages.
        any_layout: the format loads at any parallel layout (torch_dist): the TP/PP split is
            not compared.

    Raises:
        CheckpointError: every differing flag, one line each, with how to fix it.
    """
    if ckpt_args is None:
        warn_rank_0(f"{path} holds no args (the flags it was saved with): the architecture "
                    "flags cannot be checked against it")
        return
    ours = cfg.to_namespace()
    diffs = [] if any_layout else _pipeline_diffs(ckpt_args, ours)
    for name in (() if any_layout else PARALLEL_ARGS) + ARCHITECTURE_ARGS:
        theirs, mine = _built(ckpt_args, name), _built(ours, name)
        if theirs is None and name == "tensor_model_parallel_size":
            # checkpoint_version < 3.0 named the TP size model_parallel_size.
            theirs = getattr(ckpt_args, "model_parallel_size", None)
        if theirs is None or mine is None or theirs == mine:
            continue
        if name == "make_vocab_size_divisible_by" and _both_padded_sizes(ckpt_args, ours):
            continue  # the embedding's rows are what must agree; other divisors can give them
        diffs.append(f"--{name.replace('_', '-')}: checkpoint {theirs}, flags {mine}")
        if name == "padded_vocab_size":
            diffs.append(_padded_vocab_hint(ckpt_args, ours, _tokenizer_vocab_size(cfg)))
    _warn_on_another_gelu(ckpt_args, ours, path)
    _warn_on_another_norm_epsilon(ckpt_args, ours, path)
    if diffs:
        raise CheckpointError(f"checkpoint {path} does not match this run:\n  "
                              + "\n  ".join(diffs)
                              + "\n(change the flags to the checkpoint's, or pass "
                                "--use-checkpoint-args; a checkpoint saved with other "
                                "--tensor-model-parallel-size / --pipeline-model-parallel-size / "
                                "--num-layers-per-virtual-pipeline-stage must first be converted "
                                f"with {CONVERTER})")


def _built(args: argparse.Namespace, name: str):
    """The value of ``name`` as the model built from ``args`` uses it (None: not recorded).

    Megatron-LM keeps its default ``add_position_embedding=True`` in a RoPE model's args and
    builds no learned position table there (the table exists for learned_absolute only), as
    this project derives; what must agree is whether the table exists."""
    value = getattr(args, name, None)
    if name == "add_position_embedding" and value:
        kind = getattr(args, "position_embedding_type", None)
        if getattr(args, "use_rotary_position_embeddings", False) or \
                kind not in (None, "learned_absolute"):
            return False
    if name in _ROPE_ARGS and not _uses_rope(args):
        return None  # no rotary embedding: its base and shape change nothing
    return value


_ROPE_ARGS = ("rotary_base", "rotary_percent", "rotary_interleaved")


def _uses_rope(args: argparse.Namespace) -> bool:
    return getattr(args, "position_embedding_type", None) == "rope" or \
        bool(getattr(args, "use_rotary_position_embeddings", False))


def _norm_epsilon(args: argparse.Namespace) -> float | None:
    """The norms' epsilon: ``layernorm_epsilon`` (Megatron-LM 23.06 and here) or
    ``norm_epsilon`` (core_v0.13)."""
    value = getattr(args, "layernorm_epsilon", None)
    return getattr(args, "norm_epsilon", None) if value is None else value


def _warn_on_another_norm_epsilon(ckpt_args: argparse.Namespace, ours: argparse.Namespace,
                                  path: Path) -> None:
    """The epsilon changes no shape, only the outputs (slightly): warn, not refuse."""
    theirs, mine = _norm_epsilon(ckpt_args), _norm_epsilon(ours)
    if theirs is not None and mine is not None and float(theirs) != float(mine):
        warn_rank_0(f"{path} was trained with --norm-epsilon {theirs}, and this run uses "
                    f"{mine}: its outputs will differ slightly (pass --norm-epsilon {theirs}, "
                    "or --use-checkpoint-args)")


def _warn_on_another_gelu(ckpt_args: argparse.Namespace, ours: argparse.Namespace,
                          path: Path) -> None:
    """The GeLU form changes no shape, so it loads either way: say when it differs from the
    one the checkpoint was trained with (its args record bias_gelu_fusion)."""
    if getattr(ckpt_args, "bias_gelu_fusion", None) is None:
        return  # not recorded: the form it was trained with is unknown
    theirs, mine = gelu_tanh_approximation(ckpt_args), gelu_tanh_approximation(ours)
    if theirs != mine:
        form = {True: "the tanh GeLU (bias-GeLU fusion or --openai-gelu)",
                False: "the exact erf GeLU (--no-bias-gelu-fusion)"}
        warn_rank_0(f"{path} was trained with {form[theirs]}, and this run computes "
                    f"{form[mine]}: its outputs will differ (pass the checkpoint's flag, or "
                    "--use-checkpoint-args)")


def warn_past_a_sliding_window(ckpt_args: argparse.Namespace | None, cfg, path: Path,
                                weights_only: bool) -> None:
    """A checkpoint imported from a model with a sliding-window attention (Mistral's
    ``sliding_window``, recorded by tools/checkpoint/hf_llama.py) is that model only for
    sequences within the window: Megatron attends to the whole sequence. Say so when this run's
    sequences can be longer: a training run's ``--seq-length``; a tool that only reads the
    weights (generation, evaluation) takes up to ``--max-position-embeddings`` tokens."""
    window = getattr(ckpt_args, "sliding_window", None) if ckpt_args is not None else None
    if not window:
        return
    if weights_only:
        longest, flag = cfg.model.max_position_embeddings, "--max-position-embeddings"
        advice = f"keep prompt and generated text within {window} tokens"
    else:
        longest, flag = cfg.data.seq_length, "--seq-length"
        advice = f"train with --seq-length {window} or less"
    if longest is None or longest <= window:
        return
    warn_rank_0(f"{path} was imported from a model whose attention is a sliding window of "
                f"{window} tokens; Megatron attends to the whole sequence, and this run takes "
                f"sequences of up to {longest} tokens ({flag}): past {window} tokens its "
                f"outputs differ from the source model's ({advice} to keep them)")


def _both_padded_sizes(ckpt_args: argparse.Namespace, ours: argparse.Namespace) -> bool:
    return getattr(ckpt_args, "padded_vocab_size", None) is not None and \
        getattr(ours, "padded_vocab_size", None) is not None


def _tokenizer_vocab_size(cfg) -> int | None:
    """The unpadded vocabulary of this run's tokenizer (None when it cannot be built)."""
    from megatron.tokenizer import create_tokenizer
    if cfg.tokenizer.tokenizer_type is None:
        return None
    try:
        return create_tokenizer(cfg.tokenizer).vocab_size
    except ValueError:
        return None


def _padded_vocab_hint(ckpt_args: argparse.Namespace, ours: argparse.Namespace,
                       vocab_size: int | None) -> str:
    """How to build the checkpoint's embedding size: a --make-vocab-size-divisible-by whose
    padding of this tokenizer's vocabulary at this TP gives exactly the checkpoint's rows."""
    rows, tp = ckpt_args.padded_vocab_size, ours.tensor_model_parallel_size
    what = (f"  (the checkpoint's word embedding has {rows} rows; this run pads the vocabulary "
            f"to {ours.padded_vocab_size} = a multiple of --make-vocab-size-divisible-by "
            f"{ours.make_vocab_size_divisible_by} x --tensor-model-parallel-size {tp}: ")
    divisor = _divisor_padding_to(rows, vocab_size, tp, ckpt_args)
    if divisor is not None:
        return what + (f"pass --make-vocab-size-divisible-by {divisor}, or "
                       "--use-checkpoint-args)")
    return what + (f"re-pad the checkpoint with {CONVERTER} --target-vocab-size-divisible-by "
                   f"{ours.make_vocab_size_divisible_by})")


def _divisor_padding_to(rows: int, vocab_size: int | None, tp: int,
                        ckpt_args: argparse.Namespace) -> int | None:
    """A divisor d whose padding (the next multiple of d x ``tp``) takes ``vocab_size`` to
    exactly ``rows``: the checkpoint's own padding multiple at this TP when it does, else the
    smallest power of two, else ``rows / tp``. Without the vocabulary size only the first is
    offered, when the checkpoint was padded by its own args. None: no divisor does."""
    saved_divisor = getattr(ckpt_args, "make_vocab_size_divisible_by", None)
    saved_tp = getattr(ckpt_args, "tensor_model_parallel_size", None) or 1
    own = saved_divisor * saved_tp // tp if saved_divisor and \
        (saved_divisor * saved_tp) % tp == 0 else None
    if vocab_size is None:
        return own if own is not None and rows % (own * tp) == 0 else None
    candidates = [own] if own is not None else []
    candidates += [1 << k for k in range(rows.bit_length())] + [rows // tp]
    for divisor in candidates:
        multiple = divisor * tp
        if rows % multiple == 0 and rows - multiple < vocab_size <= rows:
            return divisor
    return None


def _pipeline_diffs(ckpt_args: argparse.Namespace, ours: argparse.Namespace) -> list[str]:
    """The virtual-stage split, where it differs: its layers are numbered per model chunk
    (``model0``, ``model1``...), so another split loads the wrong layers. Absent (None) means
    no virtual stages; checkpoints that record no pipeline size at all are not compared."""
    if getattr(ckpt_args, "pipeline_model_parallel_size", None) is None:
        return []
    name = "num_layers_per_virtual_pipeline_stage"
    theirs, mine = getattr(ckpt_args, name, None), getattr(ours, name, None)
    if theirs == mine:
        return []
    return [f"--{name.replace('_', '-')}: checkpoint {theirs or 'not set'}, flags "
            f"{mine or 'not set'}"]
