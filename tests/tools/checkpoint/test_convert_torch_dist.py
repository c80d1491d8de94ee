"""convert.py --source-ckpt-format / --target-ckpt-format torch_dist: a torch-format
checkpoint -> torch_dist -> torch is bitwise the original (weights, iteration; with
--keep-optimizer-state the optimizer state in the plain, distributed and bf16 layouts, the
scheduler and RNG states too); a torch_dist directory without args, or without an optimizer
state that --keep-optimizer-state asks for, is refused by name. That a converted optimizer state
resumes training exactly is tests/training/test_dist_checkpoint_8ranks.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from megatron.checkpointing import (DISTRIB_OPTIM_FILENAME, checkpoint_dir, checkpoint_name,
                                    flatten_model_state, load_checkpoint_file, nest_model_state,
                                    publish_tracker, save_file)
from megatron.checkpointing.dist import storage
from tests.checkpointing.dist.test_mcore_fixtures import MCORE
from tests.tools.checkpoint import helpers
from tools.checkpoint import convert, optimizer_state


def _run(*argv) -> None:
    assert convert.main(["--model-type", "GPT", *map(str, argv)]) == 0


def test_torch_to_torch_dist_and_back_is_bitwise(tmp_path):
    model = helpers.gpt()
    args = helpers.args_of(model)
    helpers.save_single(tmp_path / "torch", model, args)
    _run("--load-dir", tmp_path / "torch", "--save-dir", tmp_path / "dist",
         "--target-ckpt-format", "torch_dist")
    iter_dir = checkpoint_dir(tmp_path / "dist", 7)
    assert storage.is_torch_dist_dir(iter_dir)
    assert storage.read_common_state(iter_dir)["iteration"] == 7
    import torch.distributed as dist
    assert not dist.is_initialized()  # the converter's one-process world is gone
    _run("--load-dir", tmp_path / "dist", "--save-dir", tmp_path / "back",
         "--source-ckpt-format", "torch_dist")
    original = helpers.flat_model(helpers.shards(checkpoint_dir(tmp_path / "torch", 7))[0, 0])
    back = helpers.flat_model(helpers.shards(checkpoint_dir(tmp_path / "back", 7))[0, 0])
    helpers.assert_same_tensors(original, back)


def test_target_layout_flags_are_refused_with_torch_dist(tmp_path, capsys):
    assert convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path), "--save-dir",
                         str(tmp_path / "x"), "--target-ckpt-format", "torch_dist",
                         "--target-tensor-parallel-size", "2"]) == 2
    assert "loads at any TP/PP" in capsys.readouterr().err


@pytest.mark.skipif(not MCORE.is_dir(), reason=f"{MCORE} is not here")
def test_a_bare_megatron_core_directory_needs_args(tmp_path, capsys):
    """dist_checkpointing.save(model.sharded_state_dict()) stores no args: refused by name."""
    root = tmp_path / "mcore"
    shutil.copytree(MCORE / "gpt2" / "torch_dist", root / "release")
    for path in (root / "release").iterdir():
        path.chmod(0o644)
    (root / "latest_checkpointed_iteration.txt").write_text("release")
    assert convert.main(["--model-type", "GPT", "--load-dir", str(root), "--save-dir",
                         str(tmp_path / "out"), "--source-ckpt-format", "torch_dist"]) == 2
    assert "holds no args" in capsys.readouterr().err


def test_use_checkpoint_args_reads_a_torch_dist_checkpoint(tmp_path):
    from megatron.training.checkpointing import read_checkpoint_args
    model = helpers.gpt()
    helpers.save_single(tmp_path / "torch", model, helpers.args_of(model))
    _run("--load-dir", tmp_path / "torch", "--save-dir", tmp_path / "dist",
         "--target-ckpt-format", "torch_dist")
    args = read_checkpoint_args(tmp_path / "dist")
    assert args.num_layers == model.config.num_layers
    assert args.hidden_size == model.config.hidden_size


def _with_optimizer(root, *, distributed: bool, bf16: bool, family: str = "GPT"):
    """A TP1.PP1 checkpoint with Adam's state (random moments, fp32 main params of bf16
    weights), a scheduler and RNG states, written by the optimizer_state module."""
    model = helpers.gpt(num_layers=2) if family == "GPT" else helpers.bert(num_layers=2)
    args = helpers.args_of(model, use_distributed_optimizer=distributed, bf16=bf16,
                           params_dtype=torch.bfloat16 if bf16 else torch.float32)
    flat = flatten_model_state(model.state_dict_for_save_checkpoint())
    if bf16:
        flat = {k: v.to(torch.bfloat16) for k, v in flat.items()}
    gen = torch.Generator().manual_seed(5)
    names = (optimizer_state.MAIN,) * bf16 + optimizer_state.ADAM_KEYS
    states = {name: {k: torch.randn(v.shape, generator=gen) for k, v in flat.items()}
              for name in names}
    options = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
    desc = optimizer_state.OptimizerDescription(
        distributed=distributed, mixed_precision=bf16, state_keys=optimizer_state.ADAM_KEYS,
        num_steps=3, group_options={optimizer_state.DECAY: {**options, "wd_mult": 1.0},
                                    optimizer_state.NO_DECAY: {**options, "wd_mult": 0.0}},
        grad_scaler={"scale": 1.0} if bf16 else None,
        scheduler={"num_steps": 24, "max_lr": 1e-3, "warmup_steps": 2})
    sd = {"args": args, "checkpoint_version": 3.0, "iteration": 3,
          "model": nest_model_state(flat), "opt_param_scheduler": desc.scheduler,
          "rng_state": [{"torch_rng_state": torch.get_rng_state(), "np_rng_state": 7}],
          "num_floating_point_operations_so_far": 1.5e9}
    path = checkpoint_name(root, 3)
    if distributed:
        target = optimizer_state.target_of(desc, args, True)
        sd["optimizer"], distrib = optimizer_state.write_distributed(desc, target, [flat],
                                                                     [states])
        save_file(distrib, path.with_name(DISTRIB_OPTIM_FILENAME))
    else:
        sd["optimizer"] = optimizer_state.write_plain(desc, [flat], [states])
    save_file(sd, path)
    publish_tracker(root, 3, checkpoint_dir(root, 3))


def _everything(iteration_dir):
    path = next(iteration_dir.glob("mp_rank_*/model_optim_rng.pt"))
    sd = load_checkpoint_file(path)
    distrib = path.with_name(DISTRIB_OPTIM_FILENAME)
    return ({k: v for k, v in sd.items() if k not in ("args", "checkpoint_version")},
            load_checkpoint_file(distrib) if distrib.is_file() else None)


@pytest.mark.parametrize("distributed, bf16, family", [
    (False, False, "GPT"), (True, False, "GPT"), (False, True, "GPT"), (False, False, "BERT")])
def test_optimizer_state_round_trip_through_torch_dist_is_bitwise(tmp_path, distributed, bf16,
                                                                  family):
    """torch -> torch_dist -> torch with --keep-optimizer-state: the moments, main params,
    step, param groups, grad scaler, scheduler, RNG states and flop count come back bit for
    bit, in the source's optimizer layout; the torch_dist side holds Megatron-Core's
    optimizer.state.* keys at the parameters' global shapes (BERT: its heads' too)."""
    _with_optimizer(tmp_path / "torch", distributed=distributed, bf16=bf16, family=family)

    def run(*argv):
        assert convert.main(["--model-type", family, *map(str, argv)]) == 0

    run("--load-dir", tmp_path / "torch", "--save-dir", tmp_path / "dist",
        "--target-ckpt-format", "torch_dist", "--keep-optimizer-state")
    iter_dir = checkpoint_dir(tmp_path / "dist", 3)
    md = storage.read_metadata(iter_dir).state_dict_metadata
    stack = "decoder" if family == "GPT" else "encoder"
    assert tuple(md[f"optimizer.state.exp_avg.{stack}.layers.self_attention.linear_qkv.weight"]
                 .size) == (2, 3 * helpers.HIDDEN, helpers.HIDDEN)
    if family == "BERT":
        assert tuple(md["optimizer.state.exp_avg_sq.output_layer.bias"].size) == (264,)
    assert ("optimizer.state.fp32_param.embedding.word_embeddings.weight" in md) == \
        (distributed or bf16)
    common = storage.read_common_state(iter_dir)
    assert common["optimizer"]["optimizer"]["param_groups"][0]["step"] == 3
    assert common["opt_param_scheduler"]["num_steps"] == 24
    run("--load-dir", tmp_path / "dist", "--save-dir", tmp_path / "back",
        "--source-ckpt-format", "torch_dist", "--keep-optimizer-state")
    original, back = (_everything(checkpoint_dir(tmp_path / name, 3))
                      for name in ("torch", "back"))
    helpers.assert_equal_nested(back, original)


def test_keep_optimizer_state_refuses_a_torch_dist_checkpoint_without_one(tmp_path, capsys):
    model = helpers.gpt()
    helpers.save_single(tmp_path / "torch", model, helpers.args_of(model))
    _run("--load-dir", tmp_path / "torch", "--save-dir", tmp_path / "dist",
         "--target-ckpt-format", "torch_dist")
    assert convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / "dist"),
                         "--save-dir", str(tmp_path / "out"), "--source-ckpt-format",
                         "torch_dist", "--keep-optimizer-state"]) == 2
    error = capsys.readouterr().err
    assert "iter_0000007 holds no optimizer state" in error and "--no-load-optim" in error


def test_bert_to_torch_dist_and_back_is_bitwise(tmp_path):
    """--model-type BERT: Megatron-Core's BertModel keys (layers under encoder., the pooler,
    the LM head with its bias as output_layer.bias, the binary head), and back bitwise."""
    model = helpers.bert(num_layers=2)
    helpers.save_single(tmp_path / "torch", model, helpers.args_of(model, num_tokentypes=2))
    argv = ["--model-type", "BERT"]
    assert convert.main([*argv, "--load-dir", str(tmp_path / "torch"), "--save-dir",
                         str(tmp_path / "dist"), "--target-ckpt-format", "torch_dist"]) == 0
    md = storage.read_metadata(checkpoint_dir(tmp_path / "dist", 7)).state_dict_metadata
    shapes = {k: tuple(v.size) for k, v in md.items() if hasattr(v, "size")}
    hidden = helpers.HIDDEN
    assert shapes["encoder.layers.self_attention.linear_qkv.weight"] == (2, 3 * hidden, hidden)
    assert shapes["output_layer.bias"] == (264,)
    assert {"pooler.dense.weight", "lm_head.layer_norm.weight", "binary_head.bias",
            "encoder.final_layernorm.weight"} <= set(shapes)
    assert "encoder.layers.mlp.linear_fc2._extra_state/shard_1_2" in md
    assert not any(k.startswith("decoder.") for k in md)
    assert convert.main([*argv, "--load-dir", str(tmp_path / "dist"), "--save-dir",
                         str(tmp_path / "back"), "--source-ckpt-format", "torch_dist"]) == 0
    original = helpers.flat_model(helpers.shards(checkpoint_dir(tmp_path / "torch", 7))[0, 0])
    back = helpers.flat_model(helpers.shards(checkpoint_dir(tmp_path / "back", 7))[0, 0])
    helpers.assert_same_tensors(original, back)
