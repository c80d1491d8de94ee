"""The mixture-of-experts flags: Megatron-Core's names and defaults, the typed values the model
receives, and every combination that cannot run refused before any process group starts,
naming the flags."""

from __future__ import annotations

import pytest

from megatron.config.cli import parse_args
from megatron.config.core_configs import transformer_config
from megatron.config.moe_freq import moe_freq_type

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32 "
        "--max-position-embeddings 64 --micro-batch-size 2 --vocab-size 128").split()
MOE = "--num-experts 4".split()


def parse(extra: str = "", world_size: int = 1):
    return parse_args(BASE + MOE + extra.split(), world_size=world_size)


def test_megatron_defaults_and_transformer_config():
    cfg = parse()
    m = cfg.model
    assert (m.moe_router_topk, m.moe_router_load_balancing_type, m.moe_aux_loss_coeff) == \
        (2, "aux_loss", 0.0)
    assert m.moe_token_dispatcher_type == "allgather" and m.moe_router_score_function == \
        "softmax"
    assert m.moe_z_loss_coeff is None and m.moe_expert_capacity_factor is None
    assert m.moe_token_drop_policy == "probs" and m.moe_router_bias_update_rate == 1e-3
    assert m.moe_ffn_hidden_size == m.ffn_hidden_size == 256  # derived, as Megatron-LM
    assert cfg.parallel.expert_model_parallel_size == 1
    assert cfg.parallel.expert_tensor_parallel_size == 1  # = TP
    tc = transformer_config(cfg)
    assert tc.num_moe_experts == 4 and tc.moe_ffn_hidden_size == 256
    assert [tc.is_moe_layer(i) for i in range(1, 5)] == [True] * 4


def test_flags_reach_the_model_config():
    cfg = parse("--moe-router-topk 1 --moe-router-score-function sigmoid "
                "--moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01 "
                "--moe-aux-loss-coeff 0.02 --moe-z-loss-coeff 0.001 --moe-router-dtype fp32 "
                "--moe-layer-freq ([1]+[0])*2 --moe-ffn-hidden-size 32 "
                "--moe-shared-expert-intermediate-size 48 --moe-shared-expert-gate "
                "--moe-expert-capacity-factor 1.5 --moe-token-drop-policy position "
                "--moe-pad-expert-input-to-capacity --moe-token-dispatcher-type alltoall "
                "--moe-grouped-gemm --moe-per-layer-logging --moe-input-jitter-eps 0.01")
    tc = transformer_config(cfg)
    assert tc.moe_layer_freq == [1, 0, 1, 0]
    assert [tc.is_moe_layer(i) for i in range(1, 5)] == [True, False, True, False]
    assert (tc.moe_router_topk, tc.moe_router_score_function, tc.moe_router_dtype) == \
        (1, "sigmoid", "fp32")
    assert tc.moe_router_enable_expert_bias and tc.moe_router_bias_update_rate == 0.01
    assert (tc.moe_aux_loss_coeff, tc.moe_z_loss_coeff) == (0.02, 0.001)
    assert tc.moe_shared_expert_intermediate_size == 48 and tc.moe_shared_expert_gate
    assert (tc.moe_expert_capacity_factor, tc.moe_token_drop_policy) == (1.5, "position")
    assert tc.moe_pad_expert_input_to_capacity and tc.moe_grouped_gemm
    assert tc.moe_token_dispatcher_type == "alltoall" and tc.moe_per_layer_logging
    assert tc.moe_input_jitter_eps == 0.01 and tc.moe_ffn_hidden_size == 32


def test_layer_freq_int_and_expressions():
    assert moe_freq_type("2") == 2
    assert moe_freq_type("[1,1,0,1]") == [1, 1, 0, 1]
    assert moe_freq_type("([1]*3+[0]*1)*2") == [1, 1, 1, 0] * 2
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        moe_freq_type("[__import__('os')]")
    assert [transformer_config(parse("--moe-layer-freq 2")).is_moe_layer(i)
            for i in range(1, 5)] == [True, False, True, False]


def test_num_experts_zero_is_dense():
    assert transformer_config(parse_args(BASE + ["--num-experts", "0"], world_size=1)) \
        .num_moe_experts is None


@pytest.mark.parametrize("extra,world,flags", [
    ("--moe-router-topk 5", 1, ["--moe-router-topk (5)", "--num-experts (4)"]),
    ("--moe-router-topk 1", 1, ["--moe-router-topk 1", "--moe-router-pre-softmax"]),
    ("--moe-router-group-topk 2", 1, ["--moe-router-group-topk", "--moe-router-num-groups"]),
    ("--moe-router-num-groups 3 --moe-router-group-topk 1", 1,
     ["--num-experts (4)", "--moe-router-num-groups (3)"]),
    ("--moe-router-num-groups 2 --moe-router-group-topk 3", 1,
     ["--moe-router-group-topk (3)", "--moe-router-num-groups (2)"]),
    ("--moe-router-num-groups 2", 1, ["--moe-router-num-groups", "--moe-router-group-topk"]),
    ("--moe-router-enable-expert-bias", 1,
     ["--moe-router-enable-expert-bias", "--moe-router-score-function"]),
    ("--moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0.01", 1,
     ["sinkhorn", "--moe-aux-loss-coeff"]),
    ("--moe-router-load-balancing-type sinkhorn --moe-expert-capacity-factor 1", 1,
     ["--moe-expert-capacity-factor", "sinkhorn"]),
    ("--moe-router-load-balancing-type quantile_balancing", 1,
     ["quantile_balancing", "does not implement"]),
    ("--moe-pad-expert-input-to-capacity", 1,
     ["--moe-pad-expert-input-to-capacity", "--moe-expert-capacity-factor"]),
    ("--moe-layer-freq [1,0]", 1, ["--moe-layer-freq", "--num-layers"]),
    ("--moe-layer-freq [1,0,2,1]", 1, ["--moe-layer-freq"]),
    ("--moe-layer-freq 0", 1, ["--moe-layer-freq (0)"]),
    ("--expert-model-parallel-size 3", 3, ["--num-experts (4)", "--expert-model-parallel-size"]),
    ("--expert-model-parallel-size 2", 3, ["world size (3)", "--expert-model-parallel-size"]),
    ("--tensor-model-parallel-size 2", 2, ["--sequence-parallel"]),
    ("--expert-tensor-parallel-size 3", 2,
     ["world size (2)", "--expert-tensor-parallel-size (3)"]),
    ("--expert-tensor-parallel-size 2 --DDP-impl torch", 2,
     ["--expert-tensor-parallel-size 2", "--DDP-impl local"]),
    # The torch format's files: names repeat at ETP > TP; dense slices are missing at
    # ETP x EP < TP (also at EP 1: the folded grid's own ETP).
    ("--expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --save ckpt", 4,
     ["--expert-tensor-parallel-size 2", "--ckpt-format torch", "same mp_rank file",
      "--ckpt-format torch_dist"]),
    ("--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1 "
     "--load ckpt", 2, ["--expert-tensor-parallel-size 1", "--expert-model-parallel-size 1",
                        "every TP slice", "--ckpt-format torch_dist"]),
    ("--expert-model-parallel-size 2 --tensor-model-parallel-size 2", 4,
     ["--sequence-parallel"]),
    ("--moe-ffn-hidden-size 33 --tensor-model-parallel-size 2 --sequence-parallel", 2,
     ["--moe-ffn-hidden-size (33)", "--expert-tensor-parallel-size (2)"]),
    ("--moe-token-dispatcher-type flex", 1, ["--moe-token-dispatcher-type flex"]),
    ("--expert-model-parallel-size 2 --tensor-model-parallel-size 4 --sequence-parallel "
     "--expert-tensor-parallel-size 1 --save ckpt", 4,
     ["--expert-model-parallel-size 2", "--expert-tensor-parallel-size 1", "--save",
      "every TP slice"]),
    ("--moe-shared-expert-overlap", 1, ["--moe-shared-expert-overlap", "does not implement"]),
    ("--moe-router-fusion", 1, ["--moe-router-fusion"]),
    ("--moe-layer-recompute", 1, ["--moe-layer-recompute"]),
    ("--moe-use-upcycling", 1, ["--moe-use-upcycling"]),
])
def test_impossible_combinations_name_the_flags(extra, world, flags, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(extra, world_size=world)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for flag in flags:
        assert flag in err, (flag, err)


@pytest.mark.parametrize("etp", ["1", "2"])
def test_expert_parallel_with_tensor_parallel_validates(etp):
    cfg = parse("--expert-model-parallel-size 2 --tensor-model-parallel-size 2 "
                f"--sequence-parallel --expert-tensor-parallel-size {etp}", world_size=4)
    assert cfg.parallel.expert_tensor_parallel_size == int(etp)
    assert cfg.parallel.expert_model_parallel_size == 2


@pytest.mark.parametrize("etp", ["1", "2"])
@pytest.mark.parametrize("optimizer", ["", "--use-distributed-optimizer"])
def test_expert_and_tensor_parallel_torch_dist_checkpoints_validate(etp, optimizer):
    cfg = parse("--expert-model-parallel-size 2 --tensor-model-parallel-size 2 "
                f"--sequence-parallel --expert-tensor-parallel-size {etp} {optimizer} "
                "--ckpt-format torch_dist --save ckpt --save-interval 5 --load ckpt",
                world_size=4)
    assert cfg.checkpoint.ckpt_format == "torch_dist"
    assert cfg.parallel.use_distributed_optimizer == bool(optimizer)


@pytest.mark.parametrize("etp", ["1", "2"])
def test_legacy_distributed_optimizer_checkpoints_validate_at_expert_and_tensor_parallelism(
        etp):
    cfg = parse("--expert-model-parallel-size 2 --tensor-model-parallel-size 2 "
                f"--sequence-parallel --expert-tensor-parallel-size {etp} "
                "--use-distributed-optimizer --save ckpt --save-interval 5", world_size=4)
    assert cfg.parallel.expert_tensor_parallel_size == int(etp)
    assert cfg.checkpoint.ckpt_format == "torch"


@pytest.mark.parametrize("layout,world", [
    ("--tensor-model-parallel-size 4 --expert-tensor-parallel-size 2 "
     "--expert-model-parallel-size 2", 4),
    ("--expert-tensor-parallel-size 2 --expert-model-parallel-size 2", 4),
    ("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1", 2),
    ("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 4", 8),
    ("--expert-tensor-parallel-size 2 --pipeline-model-parallel-size 2", 4),
])
def test_any_expert_tensor_parallel_size_validates(layout, world):
    """ETP x EP x PP dividing the world, at any EP (EP 1 with ETP != TP folds a grid too); in
    the torch format with --save where its files hold the layout, else in torch_dist."""
    sp = "--sequence-parallel" if "--tensor-model-parallel-size" in layout else ""
    cfg = parse(f"{layout} {sp} --ckpt-format torch_dist --save ckpt --save-interval 5",
                world_size=world)
    assert cfg.parallel.expert_tensor_parallel_size == int(
        layout.split("--expert-tensor-parallel-size ")[1].split()[0])
    if "--tensor-model-parallel-size 4 --expert-tensor-parallel-size 2" in layout:
        assert parse(f"{layout} {sp} --save ckpt --save-interval 5",
                     world_size=world).checkpoint.ckpt_format == "torch"


def test_fewer_expert_than_tensor_parallel_ranks_save_in_torch_dist():
    cfg = parse("--expert-model-parallel-size 2 --tensor-model-parallel-size 4 "
                "--sequence-parallel --expert-tensor-parallel-size 1 --ckpt-format torch_dist "
                "--save ckpt --save-interval 5", world_size=4)
    assert cfg.parallel.expert_model_parallel_size == 2


def test_expert_parallel_without_experts(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--expert-model-parallel-size", "2"], world_size=2)
    assert "--num-experts" in capsys.readouterr().err


def test_expert_tensor_parallel_size_of_a_dense_model_is_ignored():
    """A dense model builds no expert grid (its writers would decide which ranks save)."""
    with pytest.warns(UserWarning, match="--expert-tensor-parallel-size 1 is ignored"):
        cfg = parse_args(BASE + ["--tensor-model-parallel-size", "2",
                                 "--expert-tensor-parallel-size", "1"], world_size=2)
    assert cfg.parallel.expert_tensor_parallel_size == 2


@pytest.mark.parametrize("extra,world", [
    ("--context-parallel-size 2 --attention-dropout 0", 2),
    ("--context-parallel-size 2 --attention-dropout 0", 4),
    ("--tensor-model-parallel-size 2 --sequence-parallel", 4),
])
def test_global_aux_loss_with_data_and_context_parallelism_validates(extra, world):
    cfg = parse(f"--moe-router-load-balancing-type global_aux_loss {extra}", world_size=world)
    assert cfg.model.moe_router_load_balancing_type == "global_aux_loss"
    assert cfg.data_parallel_size * cfg.parallel.context_parallel_size * \
        cfg.parallel.tensor_model_parallel_size == world
