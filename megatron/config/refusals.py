"""Flags refused whatever the rest of the command line: deprecated Megatron-LM spellings, and
Megatron-LM flags (and combinations) this framework accepts so that scripts parse but has not
built. Setting one is an error rather than a silent no-op.
"""

from __future__ import annotations

import dataclasses

# Megatron-LM flags that are accepted (so scripts parse) but whose feature is not built yet.
# Setting one to a non-default value is an error rather than a silent no-op.
NOT_IMPLEMENTED: dict[tuple[str, str], str] = {
    ("model", "moe_shared_expert_overlap"): "--moe-shared-expert-overlap",
    ("model", "moe_router_fusion"): "--moe-router-fusion",
    ("model", "moe_router_force_load_balancing"): "--moe-router-force-load-balancing",
    ("model", "moe_permute_fusion"): "--moe-permute-fusion",
    ("model", "moe_layer_recompute"): "--moe-layer-recompute",
    ("model", "moe_use_upcycling"): "--moe-use-upcycling",
    ("model", "encoder_num_layers"): "--encoder-num-layers",
    ("model", "decoder_num_layers"): "--decoder-num-layers",
    ("model", "embedding_weights_in_fp32"): "--embedding-weights-in-fp32",
    ("model", "init_method_xavier_uniform"): "--init-method-xavier-uniform",
    ("precision", "fp32_residual_connection"): "--fp32-residual-connection",
    ("parallel", "use_ring_exchange_p2p"): "--use-ring-exchange-p2p",
    # Interleaved schedule only (dropped without it, as Megatron-LM does): p2p runs blocking.
    ("parallel", "overlap_p2p_comm"): "--overlap-p2p-communication",
    ("parallel", "standalone_embedding_stage"): "--standalone-embedding-stage",
    ("parallel", "pipeline_model_parallel_split_rank"): "--pipeline-model-parallel-split-rank",
    ("data", "retriever_seq_length"): "--retriever-seq-length",
    # torch_dist: every rank reads its own chunks; plans are built at every save.
    ("checkpoint", "ckpt_fully_parallel_load"): "--ckpt-fully-parallel-load",
    ("checkpoint", "ckpt_assume_constant_structure"): "--ckpt-assume-constant-structure",
}

_DEPRECATED = {
    ("training", "batch_size"): ("--batch-size", "--micro-batch-size"),
    ("optimizer", "warmup"): ("--warmup", "--lr-warmup-fraction"),
    ("parallel", "model_parallel_size"): ("--model-parallel-size", "--tensor-model-parallel-size"),
    ("training", "checkpoint_activations"): (
        "--checkpoint-activations", "--recompute-activations or --recompute-granularity"),
}


def check_deprecated(cfg) -> None:
    for (section, name), (old, new) in _DEPRECATED.items():
        value = getattr(getattr(cfg, section), name)
        if value not in (None, False):
            raise ValueError(f"{old} is no longer supported; use {new}")


def check_not_implemented(cfg) -> None:
    for (section, name), flag in NOT_IMPLEMENTED.items():
        sec = getattr(cfg, section)
        default = {f.name: f.default for f in dataclasses.fields(sec)}[name]
        if getattr(sec, name) != default:
            raise ValueError(f"{flag} is a Megatron-LM flag this framework does not implement yet")
    _check_pipeline_not_implemented(cfg)
    if cfg.model.transformer_impl != "local":
        raise ValueError("--transformer-impl transformer_engine needs NVIDIA Transformer Engine, "
                         "which this framework does not use; use --transformer-impl local")


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
