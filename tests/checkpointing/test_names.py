"""Checkpoint names and the tracker without a process group, and the whole
package driven from a plain Python script: it imports neither megatron.config nor
megatron.training, and writes, finds, reads and merges a TP = 2 checkpoint."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron.checkpointing import (CheckpointError, checkpoint_dir, checkpoint_name,
                                    parse_tracker, publish_tracker, shard_dir_name, shard_files,
                                    tracker_path)

REPO = Path(__file__).resolve().parents[2]


def test_megatron_names():
    assert checkpoint_dir("/s", 500) == Path("/s/iter_0000500")
    assert checkpoint_dir("/s", 500, release=True) == Path("/s/release")
    assert checkpoint_dir("/s", 12_345_678).name == "iter_12345678"
    assert shard_dir_name(1) == "mp_rank_01"
    assert shard_dir_name(1, 2, pipeline_parallel=True) == "mp_rank_01_002"
    assert shard_dir_name(0, 0, pipeline_parallel=True) == "mp_rank_00_000"
    assert checkpoint_name("/s", 3, tensor_rank=1, pipeline_rank=2, pipeline_parallel=True) == \
        Path("/s/iter_0000003/mp_rank_01_002/model_optim_rng.pt")
    assert tracker_path("/s") == Path("/s/latest_checkpointed_iteration.txt")


def test_tracker_round_trip(tmp_path):
    tracker = tracker_path(tmp_path)
    assert parse_tracker(tracker) is None
    assert publish_tracker(tmp_path, 7, tmp_path) is None
    assert tracker.read_text() == "7" and parse_tracker(tracker) == (7, False)
    assert publish_tracker(tmp_path, 3, tmp_path) == (7, False)  # the caller warns: moved back
    tracker.write_text("release\n")
    assert parse_tracker(tracker) == (0, True)
    tracker.write_text("latest")
    with pytest.raises(CheckpointError, match="iteration number or 'release', found 'latest'"):
        parse_tracker(tracker)


def test_shard_files_by_tensor_and_pipeline_rank(tmp_path):
    for name in ("mp_rank_01_001", "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_optim_rng.pt").touch()
    (tmp_path / "mp_rank_xx").mkdir()  # not a shard
    (tmp_path / "mp_rank_xx" / "model_optim_rng.pt").touch()
    found = shard_files(tmp_path)
    assert list(found) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert found[(1, 0)] == tmp_path / "mp_rank_01_000" / "model_optim_rng.pt"
    assert list(shard_files(tmp_path / "none")) == []
    (tmp_path / "mp_rank_00_000_001").mkdir()
    (tmp_path / "mp_rank_00_000_001" / "model_optim_rng.pt").touch()
    with pytest.raises(CheckpointError, match="expert-parallel"):
        shard_files(tmp_path)


_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from megatron import checkpointing as ckpt

    root = sys.argv[1]
    full = {"language_model.embedding.word_embeddings.weight": torch.arange(8.).view(4, 2),
            "language_model.encoder.layers.0.self_attention.dense.weight": torch.ones(2, 4),
            "language_model.encoder.final_layernorm.bias": torch.zeros(2)}
    digests = {}
    for rank, shard in enumerate(ckpt.GPT_LAYOUT.split_tensor_parallel(full, 2)):
        sd = {"model": ckpt.nest_model_state(shard), "checkpoint_version": 3.0, "iteration": 5}
        name = ckpt.checkpoint_name(root, 5, tensor_rank=rank)
        digests[ckpt.manifest_entry(name)] = ckpt.save_file(sd, name)
    ckpt.write_manifest(ckpt.checkpoint_dir(root, 5), digests)
    ckpt.publish_tracker(root, 5, ckpt.checkpoint_dir(root, 5))
    shards = ckpt.shard_files(ckpt.latest_checkpoint_dir(root))
    read = [ckpt.flatten_model_state(ckpt.load_checkpoint_file(shards[(t, 0)])["model"])
            for t in range(2)]
    assert all(ckpt.verify_checksum(path) for path in shards.values())
    merged = ckpt.GPT_LAYOUT.merge_tensor_parallel(read)
    assert list(merged) == list(full) and all(torch.equal(merged[k], full[k]) for k in full)
    assert read[1]["language_model.encoder.layers.0.self_attention.dense.weight"].shape == (2, 2)
    assert not torch.distributed.is_initialized()
    loaded = sorted(m for m in sys.modules if m.startswith("megatron."))
    assert not [m for m in loaded if m.startswith(("megatron.config", "megatron.training"))]
    print(" ".join(loaded))
""")


def test_the_package_works_from_a_plain_script(tmp_path):
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "ckpt")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "megatron.checkpointing.layout" in done.stdout.split()
