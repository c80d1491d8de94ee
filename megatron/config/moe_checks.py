"""The mixture-of-experts flag checks (Megatron-Core's ``TransformerConfig`` and
``validate_args`` rules, plus what is not built here), called by
:func:`megatron.config.validate.validate` before any process group starts."""

from __future__ import annotations

import warnings

_AUX_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def derive_moe(cfg) -> None:
    """Megatron-LM's defaults: --num-experts 0 means none; --moe-ffn-hidden-size defaults to
    --ffn-hidden-size; --expert-tensor-parallel-size to the TP size (and is the TP size in a
    dense model, with a warning when given otherwise); a negative capacity factor means
    dropless."""
    m, par = cfg.model, cfg.parallel
    if m.num_experts == 0:
        m.num_experts = None
    if m.num_experts is not None and m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size
    tp, etp = par.tensor_model_parallel_size, par.expert_tensor_parallel_size
    if m.num_experts is None and etp is not None and etp != tp:
        # The expert grid would be built for no expert, and its writers would then decide
        # which ranks save a dense model's files.
        warnings.warn(f"--expert-tensor-parallel-size {etp} is ignored without --num-experts "
                      "(a dense model has no experts)", stacklevel=3)
        etp = None
    if etp is None:
        par.expert_tensor_parallel_size = tp
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
    if ep > 1 or etp != tp:
        _check_expert_grid(cfg, ep, etp)
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


def _check_expert_grid(cfg, ep: int, etp: int) -> None:
    """What the expert grid (EP > 1 or ETP != TP, any ETP x EP x PP dividing the world) is
    built with: local DDP's contiguous buffers, and in the torch format only the layouts whose
    files Megatron-LM's naming can hold. It composes with TP, SP, PP (with virtual stages), DP
    and CP in any combination: the grid has no CP dimension, and the tokens are local to each
    rank whatever TP and CP split."""
    par, ck = cfg.parallel, cfg.checkpoint
    tp = par.tensor_model_parallel_size
    flags = f"--expert-tensor-parallel-size {etp} with --expert-model-parallel-size {ep}"
    if par.ddp_impl != "local" or not par.use_contiguous_buffers_in_local_ddp:
        raise ValueError(f"{flags} needs --DDP-impl local with its contiguous buffers (the "
                         "expert gradients have their own buffers over the expert-data-"
                         "parallel group)")
    if ck.ckpt_format == "torch" and (ck.save is not None or ck.load is not None) and \
            (etp > tp or etp * ep < tp):
        # The writers are the expert-data-parallel rank-0 ranks r < ETP x EP of each stage, in
        # file mp_rank_{r mod TP}_{r // ETP}: the names repeat when ETP > TP, and the dense TP
        # slices r mod TP miss some when ETP x EP < TP.
        why = (f"two ranks of one expert-parallel rank would write the same mp_rank file "
               f"(--expert-tensor-parallel-size above --tensor-model-parallel-size {tp})"
               if etp > tp else
               f"the mp_rank files would not hold every TP slice of the dense layers "
               f"(--expert-tensor-parallel-size x --expert-model-parallel-size below "
               f"--tensor-model-parallel-size {tp})")
        raise ValueError(f"{flags} and --save / --load in --ckpt-format torch: {why}; use "
                         "--ckpt-format torch_dist (any layout), or ETP <= TP <= ETP x EP")
