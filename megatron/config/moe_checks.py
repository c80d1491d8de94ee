"""The mixture-of-experts flag checks (Megatron-Core's ``TransformerConfig`` and
``validate_args`` rules, plus what is not built here), called by
:func:`megatron.config.validate.validate` before any process group starts."""

from __future__ import annotations

_AUX_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def derive_moe(cfg) -> None:
    """Megatron-LM's defaults: --num-experts 0 means none; --moe-ffn-hidden-size defaults to
    --ffn-hidden-size; --expert-tensor-parallel-size to the TP size; a negative capacity
    factor means dropless."""
    m, par = cfg.model, cfg.parallel
    if m.num_experts == 0:
        m.num_experts = None
    if m.num_experts is not None and m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size
    if par.expert_tensor_parallel_size is None:
        par.expert_tensor_parallel_size = par.tensor_model_parallel_size
    if m.moe_expert_capacity_factor is not None and m.moe_expert_capacity_factor < 0:
        m.moe_expert_capacity_factor = None


def check_moe(cfg, world_size: int) -> None:
    """Every MoE flag combination this framework cannot run, naming the flags."""
    m, par = cfg.model, cfg.parallel
    if m.num_experts is None:
        if par.expert_model_parallel_size > 1:
            raise ValueError(f"--expert-model-parallel-size {par.expert_model_parallel_size} "
                             "needs --num-experts (a mixture-of-experts model)")
        return
    _check_router(m)
    _check_balancing(m)
    _check_capacity(m)
    _check_layer_freq(m)
    _check_moe_parallel(cfg, world_size)


def _check_router(m) -> None:
    e, k = m.num_experts, m.moe_router_topk
    if k < 1 or k > e:
        raise ValueError(f"--moe-router-topk ({k}) must be between 1 and --num-experts ({e})")
    if k == 1 and m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax \
            and m.moe_router_load_balancing_type != "sinkhorn":
        raise ValueError("--moe-router-topk 1 with softmax scores needs "
                         "--moe-router-pre-softmax (a softmax over one score has zero gradient)")
    groups, gk = m.moe_router_num_groups, m.moe_router_group_topk
    if gk is not None:
        if groups is None:
            raise ValueError("--moe-router-group-topk needs --moe-router-num-groups")
        if e % groups != 0:
            raise ValueError(f"--num-experts ({e}) is not divisible by "
                             f"--moe-router-num-groups ({groups})")
        if gk > groups:
            raise ValueError(f"--moe-router-group-topk ({gk}) is larger than "
                             f"--moe-router-num-groups ({groups})")
        if gk > k or gk * (e // groups) < k:
            raise ValueError(f"--moe-router-group-topk ({gk}) groups of {e // groups} experts "
                             f"cannot hold --moe-router-topk ({k}) experts with at least one "
                             "from each chosen group; change the group or top-k sizes")
    elif groups is not None:
        raise ValueError("--moe-router-num-groups without --moe-router-group-topk does not "
                         "limit the routing; give both or neither")
    if m.moe_router_enable_expert_bias and \
            m.moe_router_score_function not in ("sigmoid", "sqrtsoftplus"):
        raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function "
                         "sigmoid or sqrtsoftplus (Megatron-Core's rule)")


def _check_balancing(m) -> None:
    kind = m.moe_router_load_balancing_type
    if kind == "quantile_balancing":
        raise ValueError("--moe-router-load-balancing-type quantile_balancing is a Megatron-LM "
                         "option this framework does not implement yet")
    if kind == "sinkhorn" and m.moe_aux_loss_coeff != 0:
        raise ValueError("--moe-router-load-balancing-type sinkhorn has no auxiliary loss: "
                         "drop --moe-aux-loss-coeff")


def _check_capacity(m) -> None:
    if m.moe_expert_capacity_factor is not None:
        if m.moe_router_load_balancing_type not in (*_AUX_LOSSES, "none"):
            raise ValueError("--moe-expert-capacity-factor works with the aux_loss, "
                             "seq_aux_loss, global_aux_loss or none load balancing, not "
                             f"{m.moe_router_load_balancing_type}")
    elif m.moe_pad_expert_input_to_capacity:
        raise ValueError("--moe-pad-expert-input-to-capacity needs "
                         "--moe-expert-capacity-factor")


def _check_layer_freq(m) -> None:
    freq = m.moe_layer_freq
    if isinstance(freq, int) or m.num_layers is None:
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"--moe-layer-freq ({freq}) must be at least 1")
        return
    if len(freq) != m.num_layers:
        raise ValueError(f"--moe-layer-freq lists {len(freq)} layers; --num-layers is "
                         f"{m.num_layers}")
    if any(v not in (0, 1) for v in freq):
        raise ValueError(f"--moe-layer-freq {freq}: every entry must be 0 (dense) or 1 (MoE)")


def _check_moe_parallel(cfg, world_size: int) -> None:
    m, par = cfg.model, cfg.parallel
    tp, ep, etp = (par.tensor_model_parallel_size, par.expert_model_parallel_size,
                   par.expert_tensor_parallel_size)
    pp = par.pipeline_model_parallel_size
    if m.num_experts % ep != 0:
        raise ValueError(f"--num-experts ({m.num_experts}) is not divisible by "
                         f"--expert-model-parallel-size ({ep})")
    if world_size % (etp * ep * pp) != 0:
        raise ValueError(f"world size ({world_size}) is not divisible by "
                         f"--expert-tensor-parallel-size ({etp}) x --expert-model-parallel-size "
                         f"({ep}) x --pipeline-model-parallel-size ({pp})")
    if ep > 1:
        _check_expert_parallel(cfg, ep)
        if etp not in (1, tp):
            raise ValueError(f"--expert-tensor-parallel-size ({etp}) other than 1 or "
                             f"--tensor-model-parallel-size ({tp}) is a Megatron-LM option this "
                             "framework does not implement yet")
    elif etp != tp:
        raise ValueError(f"--expert-tensor-parallel-size ({etp}) different from "
                         f"--tensor-model-parallel-size ({tp}) at --expert-model-parallel-size 1 "
                         "is a Megatron-LM option this framework does not implement yet (the "
                         "expert grid is built with expert parallelism only)")
    if tp > 1 and not par.sequence_parallel:
        raise ValueError("--num-experts with --tensor-model-parallel-size > 1 needs "
                         "--sequence-parallel (each TP rank routes its own rows)")
    if m.moe_ffn_hidden_size is not None and m.moe_ffn_hidden_size % etp != 0:
        raise ValueError(f"--moe-ffn-hidden-size ({m.moe_ffn_hidden_size}) is not divisible "
                         f"by --expert-tensor-parallel-size ({etp})")
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None and (shared <= 0 or shared % tp != 0):
        raise ValueError(f"--moe-shared-expert-intermediate-size ({shared}) must be positive "
                         f"and divisible by --tensor-model-parallel-size ({tp})")
    if m.moe_token_dispatcher_type == "flex":
        raise ValueError("--moe-token-dispatcher-type flex (DeepEP / HybridEP) is a "
                         "Megatron-LM option this framework does not implement yet; use "
                         "allgather or alltoall")


def _check_expert_parallel(cfg, ep: int) -> None:
    """What expert parallelism is built with: the expert grid (ETP 1 or TP, sequence
    parallelism at TP > 1) under tensor, data, pipeline (with virtual stages) and context
    parallelism in any combination (local DDP's contiguous buffers, with or without the
    distributed optimizer). The expert grid has no CP dimension: the tokens are local to each
    rank whatever TP and CP split, so nothing of the experts depends on CP. The rest is refused
    by name."""
    par, ck = cfg.parallel, cfg.checkpoint
    flag = f"--expert-model-parallel-size {ep}"
    tp = par.tensor_model_parallel_size
    etp = par.expert_tensor_parallel_size
    if etp == 1 and ep < tp and ck.ckpt_format == "torch" and \
            (ck.save is not None or ck.load is not None):
        # Each EP rank's file holds one TP slice of the dense layers (the writer of EP rank e
        # is rank e of its stage, TP rank e mod TP, whatever CP and DP): fewer EP than TP ranks
        # would leave slices unwritten.
        raise ValueError(f"{flag} below --tensor-model-parallel-size {tp} with "
                         "--expert-tensor-parallel-size 1 and --save / --load: the torch "
                         "format's mp_rank_TT_EEE files would not hold every TP slice of the "
                         "dense layers; use --expert-model-parallel-size >= TP or --ckpt-format "
                         "torch_dist")
    if par.ddp_impl != "local" or not par.use_contiguous_buffers_in_local_ddp:
        raise ValueError(f"{flag} needs --DDP-impl local with its contiguous buffers (the "
                         "expert gradients have their own buffers over the expert-data-"
                         "parallel group)")
