"""convert.py --source-ckpt-format / --target-ckpt-format torch_dist: a torch-format
checkpoint -> torch_dist -> torch is bitwise the original (weights, iteration); a torch_dist
directory without args is refused by name."""

from __future__ import annotations

import shutil

import pytest

from megatron.checkpointing import checkpoint_dir
from megatron.checkpointing.dist import storage
from tests.checkpointing.dist.test_mcore_fixtures import MCORE
from tests.tools.checkpoint import helpers
from tools.checkpoint import convert


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
