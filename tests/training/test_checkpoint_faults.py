"""Checkpoint faults: a full disk, a mistyped --load, corrupt files.

Unit level (this process, no process group; a ``Linear`` stands for the model and
``save_checkpoint`` / ``load_checkpoint`` are called directly):

* a full disk during a save (the writer raises ENOSPC half-way): an error naming the directory,
  the bytes needed and the free space; the previous checkpoint and tracker intact; no temporary
  file left; temporary files of a killed save are removed by the next save (only ours);
* a save to an older iteration says that the tracker moves back;
* --load holding no checkpoint while --save holds some: refused (both paths named) unless
  --allow-overwrite-checkpoints; no --load at all, the same;
* 0-byte shard, binary or non-numeric tracker, non-integer iteration: "corrupt or truncated
  checkpoint file FILE";
* checksums: one manifest per iteration directory (sha256sum format), nothing but the shard in
  its mp_rank directory, a flipped bit refused naming the file (--no-verify-checkpoint-checksums
  loads it), a shard without one (Megatron-LM's) loads with one quiet line, the ``.sha256``
  beside a shard of a checkpoint saved before the manifest still checked, and plain
  ``torch.load`` (what Megatron-LM calls) still reads ours.

End to end through ``pretrain()`` (pooled world of 1): the issue's ``--save RUN --load RUN_TYPO``
leaves RUN untouched; a checkpoint without ``args`` is refused for resuming, resumes with
--allow-resume-without-checkpoint-args, and loads for --finetune without it.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from megatron.config import parse_args
from megatron.checkpointing import files as checkpoint_files
from megatron.training.checkpointing import (MODEL_FILENAME, TRACKER_FILENAME, CheckpointError,
                                             check_fresh_start, load_checkpoint,
                                             load_checkpoint_file,
                                             remove_interrupted_save_files, save_checkpoint)
from tests.training import e2e

TINY = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
        "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1"]
WIDTH = 128  # Linear(128, 128): 64 KiB of weights


def _cfg(save: Path | None = None, load: Path | None = None, *extra: str):
    argv = [*TINY, "--no-load-rng", *extra]
    if save is not None:
        argv += ["--save", str(save), "--save-interval", "1"]
    if load is not None:
        argv += ["--load", str(load)]
    return parse_args(argv, world_size=1)


def _model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(WIDTH, WIDTH)


def _save(root: Path, iteration: int, model: torch.nn.Module | None = None) -> Path:
    save_checkpoint(iteration, [model or _model(iteration)], None, None, _cfg(root),
                    consumed_train_samples=8 * iteration, consumed_valid_samples=0)
    return _shard(root, iteration)


def _shard(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}" / "mp_rank_00" / MODEL_FILENAME


def _load(root: Path, *extra: str, model: torch.nn.Module | None = None):
    return load_checkpoint([model or _model(99)], None, None, _cfg(None, root, *extra))


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name]



class _Disk:
    """The file a save writes to, on a disk with ``room`` bytes left: then write(2) fails."""

    def __init__(self, raw, room: int, error: OSError) -> None:
        self.raw, self.room, self.error = raw, room, error

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            raise self.error
        self.room -= size
        return self.raw.write(data)

    def flush(self) -> None:
        self.raw.flush()


def _disk_with_room(monkeypatch, room: int, error: OSError) -> None:
    """Every checkpoint file written through HashingWriter lands on that disk."""
    real_init = checkpoint_files.HashingWriter.__init__

    def on_disk(self, raw):
        real_init(self, _Disk(raw, room, error))

    monkeypatch.setattr(checkpoint_files.HashingWriter, "__init__", on_disk)


# ---------------------------------------------------------------------------------------------
# 3. A full disk during a save
# ---------------------------------------------------------------------------------------------

def test_full_disk_names_directory_bytes_needed_and_free_space(tmp_path, monkeypatch):
    root = tmp_path / "run"
    _save(root, 2)
    # The disk takes 10 kB of the new shard, then is full. (torch's zip writer then fails on
    # its own while closing the archive, "unexpected pos": the disk's error must win.)
    _disk_with_room(monkeypatch, 10_000, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(CheckpointError) as caught:
        _save(root, 4)
    message = str(caught.value)
    directory = _shard(root, 4).parent
    assert f"in {directory}:" in message and MODEL_FILENAME in message, message
    needed = re.search(r"needs about [\d.]+ KiB \((\d+) bytes\)", message)
    assert needed and int(needed.group(1)) >= WIDTH * WIDTH * 4, message
    free = re.search(r"\((\d+) bytes\) free there|(\d+) bytes free there", message)
    assert free, message
    assert "No space left on device" in message and "--save" in message
    # The previous checkpoint and its tracker are intact; nothing half-written is left.
    assert (root / TRACKER_FILENAME).read_text() == "2"
    assert not _shard(root, 4).exists()
    assert _temp_files(root) == []
    monkeypatch.undo()
    assert _load(root)[0] == 2


def test_write_errors_other_than_space_name_the_file(tmp_path, monkeypatch):
    root = tmp_path / "run"
    _disk_with_room(monkeypatch, 0, OSError(errno.EROFS, "Read-only file system"))
    with pytest.raises(CheckpointError, match=r"could not write checkpoint file .*"
                                              r"model_optim_rng\.pt: Read-only file system"):
        _save(root, 2)
    assert _temp_files(root) == []


def test_temp_files_of_a_killed_save_are_removed_at_the_next_start(tmp_path):
    root = tmp_path / "run"
    _save(root, 2)
    shard_dir = _shard(root, 2).parent
    stale = [shard_dir / ".model_optim_rng.pt.tmp-4242",
             shard_dir / ".model_optim_rng.pt.sha256.tmp-4242",
             shard_dir.parent / ".checksums.sha256.tmp-7",
             root / "iter_0000004" / "mp_rank_01" / ".distrib_optim.pt.tmp-17",
             root / f".{TRACKER_FILENAME}.tmp-99"]
    # Not ours (other names, other places, no pid): left alone.
    kept = [shard_dir / ".model_optim_rng.pt.tmp-old", shard_dir / "notes.tmp-1",
            shard_dir / ".optimizer.pt.tmp-5", root / "scratch" / ".model_optim_rng.pt.tmp-1",
            root / "iter_0000002" / ".model_optim_rng.pt.tmp-3", root / "run.tmp"]
    for path in stale + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * 4096)
    remove_interrupted_save_files(root)  # what setup_model_and_optimizer runs at start-up
    assert [p for p in stale if p.exists()] == []
    assert [p for p in kept if not p.exists()] == []
    assert (root / TRACKER_FILENAME).read_text() == "2"


def test_save_to_an_older_iteration_says_the_tracker_moves_back(tmp_path, megatron_log):
    root = tmp_path / "run"
    _save(root, 4)
    assert not [r for r in megatron_log if "moves back" in r.getMessage()]
    _save(root, 2)
    assert (root / TRACKER_FILENAME).read_text() == "2"
    warnings = [r.getMessage() for r in megatron_log if "moves back" in r.getMessage()]
    assert len(warnings) == 1 and "from iteration 4 to 2" in warnings[0], warnings


# ---------------------------------------------------------------------------------------------
# 4. A mistyped --load
# ---------------------------------------------------------------------------------------------

def test_load_without_checkpoint_while_save_holds_some_is_refused(tmp_path):
    run, typo = tmp_path / "run", tmp_path / "run_typo"
    _save(run, 4)
    cfg = _cfg(run, typo)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint([_model()], None, None, cfg)
    message = str(caught.value)
    assert f"--load {typo} holds no checkpoint" in message
    assert f"--save {run} already holds checkpoints" in message and "iteration 4" in message
    assert "--allow-overwrite-checkpoints" in message
    # No --load at all (pretrain calls check_fresh_start): refused as well.
    with pytest.raises(CheckpointError, match="no --load was given, but --save"):
        check_fresh_start(_cfg(run))
    # Allowed explicitly; and nothing to protect in an empty --save, or with --load == --save
    # on a first start, or without training (--skip-train saves nothing).
    assert load_checkpoint([_model()], None, None,
                           _cfg(run, typo, "--allow-overwrite-checkpoints")) == (0, 0, 0)
    assert load_checkpoint([_model()], None, None, _cfg(tmp_path / "new", typo)) == (0, 0, 0)
    first = tmp_path / "first"
    assert load_checkpoint([_model()], None, None, _cfg(first, first)) == (0, 0, 0)
    check_fresh_start(_cfg(run, None, "--skip-train", "--random-weights"))
    assert (run / TRACKER_FILENAME).read_text() == "4"


def test_evaluation_refuses_a_load_without_checkpoint(tmp_path):
    # --skip-train with a --load that holds nothing (e.g. mistyped): refused, not evaluated
    # from random weights; --random-weights asks for that (and excludes --load).
    empty = tmp_path / "typo"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="holds no"):
        load_checkpoint([_model()], None, None, _cfg(None, empty, "--skip-train"))
    for extra in (["--skip-train"], ["--skip-train", "--random-weights", "--load", str(empty)]):
        with pytest.raises(SystemExit):
            parse_args([*TINY, *extra], world_size=1)
    assert parse_args([*TINY, "--skip-train", "--random-weights"], world_size=1)


# ---------------------------------------------------------------------------------------------
# 5. Corrupt checkpoints
# ---------------------------------------------------------------------------------------------

def _rewrite(shard: Path, change) -> None:
    """Rewrite a shard as another tool would: no checksum recorded for it."""
    sd = torch.load(shard, map_location="cpu", weights_only=False)
    sd = change(sd)
    torch.save(sd, shard)
    checkpoint_files.manifest_path(shard).unlink(missing_ok=True)


def _zero_bytes(root: Path) -> Path:
    shard = _shard(root, 2)
    shard.write_bytes(b"")
    checkpoint_files.manifest_path(shard).unlink(missing_ok=True)
    return shard


def _tracker(content: bytes):
    def corrupt(root: Path) -> Path:
        (root / TRACKER_FILENAME).write_bytes(content)
        return root / TRACKER_FILENAME
    return corrupt


def _iteration(value):
    def corrupt(root: Path) -> Path:
        _rewrite(_shard(root, 2), lambda sd: {**sd, "iteration": value})
        return _shard(root, 2)
    return corrupt


def _not_a_dict(root: Path) -> Path:
    _rewrite(_shard(root, 2), lambda sd: [sd["model"]])
    return _shard(root, 2)


@pytest.mark.parametrize("corrupt", [
    _zero_bytes, _tracker(b"\x89PNG\r\n\x1a\n\x00\xff"), _tracker(b"12abc"), _tracker(b"-3"),
    _iteration("2"), _iteration(2.5), _iteration(-1), _not_a_dict,
], ids=["zero_byte_shard", "binary_tracker", "text_tracker", "negative_tracker",
        "iteration_str", "iteration_float", "iteration_negative", "not_a_dict"])
def test_corrupt_files_are_named(tmp_path, corrupt):
    root = tmp_path / "run"
    _save(root, 2)
    path = corrupt(root)
    with pytest.raises(CheckpointError) as caught:
        _load(root)
    assert str(caught.value).startswith(f"corrupt or truncated checkpoint file {path}: "), \
        str(caught.value)


def test_zero_byte_file_read_directly_is_named(tmp_path):
    path = tmp_path / MODEL_FILENAME
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=rf"corrupt or truncated checkpoint file {path}: "
                                              r"EOFError"):
        load_checkpoint_file(path)


def test_checksum_in_the_iteration_manifest_and_megatron_can_read_the_shard(tmp_path):
    root = tmp_path / "run"
    model = _model(7)
    shard = _save(root, 2, model)
    assert [p.name for p in shard.parent.iterdir()] == [MODEL_FILENAME]  # as Megatron-LM's
    manifest = shard.parent.parent / "checksums.sha256"
    digest = hashlib.sha256(shard.read_bytes()).hexdigest()
    # sha256sum -c reads it, run in the iteration directory.
    assert manifest.read_text() == f"{digest}  mp_rank_00/{MODEL_FILENAME}\n"
    # What Megatron-LM calls: plain torch.load of the path.
    sd = torch.load(shard, map_location="cpu", weights_only=False)
    assert torch.equal(sd["model"]["weight"], model.weight)
    assert sd["iteration"] == 2 and sd["args"].consumed_train_samples == 16


def _flip_one_bit_of(shard: Path, tensor: torch.Tensor) -> None:
    data = bytearray(shard.read_bytes())
    at = bytes(data).find(tensor.detach().numpy().tobytes())
    assert at >= 0
    data[at + 1001] ^= 0x04
    shard.write_bytes(bytes(data))


def test_flipped_bit_is_refused_naming_the_file(tmp_path):
    root = tmp_path / "run"
    saved = _model(3)
    shard = _save(root, 2, saved)
    _flip_one_bit_of(shard, saved.weight)
    with pytest.raises(CheckpointError) as caught:
        _load(root)
    message = str(caught.value)
    assert message.startswith(f"corrupt or truncated checkpoint file {shard}: its sha256")
    assert "--no-verify-checkpoint-checksums" in message
    # Unchecked, it loads: the flipped bit would have gone unnoticed.
    loaded = _model(99)
    assert _load(root, "--no-verify-checkpoint-checksums", model=loaded)[0] == 2
    assert int((loaded.weight != saved.weight).sum()) == 1


@pytest.mark.parametrize("where", ["manifest", "beside"])
def test_malformed_checksum_file_is_named(tmp_path, where):
    root = tmp_path / "run"
    shard = _save(root, 2)
    recorded = checkpoint_files.manifest_path(shard)
    if where == "beside":  # a checkpoint saved before the manifest
        recorded.unlink()
        recorded = checkpoint_files.checksum_path(shard)
    recorded.write_text("not a digest\n")
    with pytest.raises(CheckpointError, match=f"corrupt or truncated checkpoint file {recorded}"):
        _load(root)


def _as_saved_before_the_manifest(shard: Path) -> Path:
    """The manifest replaced by the ``<shard>.sha256`` beside the shard that saves wrote then."""
    checkpoint_files.manifest_path(shard).unlink()
    digest = hashlib.sha256(shard.read_bytes()).hexdigest()
    recorded = checkpoint_files.checksum_path(shard)
    recorded.write_text(checkpoint_files.checksum_text(digest, shard))
    return recorded


def test_checksum_beside_a_shard_of_an_older_save_is_still_checked(tmp_path, megatron_log):
    root = tmp_path / "run"
    saved = _model(6)
    shard = _save(root, 2, saved)
    recorded = _as_saved_before_the_manifest(shard)
    loaded = _model(99)
    assert _load(root, model=loaded) == (2, 16, 0)
    assert torch.equal(loaded.weight, saved.weight)
    assert not [r for r in megatron_log if "no sha256 recorded" in r.getMessage()]
    _flip_one_bit_of(shard, saved.weight)
    with pytest.raises(CheckpointError, match=f"its sha256 .* but {recorded} recorded"):
        _load(root)


def test_shard_without_checksum_loads_with_one_quiet_line(tmp_path, megatron_log):
    root = tmp_path / "run"
    saved = _model(5)
    shard = _save(root, 2, saved)
    checkpoint_files.manifest_path(shard).unlink()  # as Megatron-LM writes it
    loaded = _model(99)
    assert _load(root, model=loaded) == (2, 16, 0)
    assert torch.equal(loaded.weight, saved.weight)
    notes = [r for r in megatron_log if "no sha256 recorded" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO, notes


def test_checkpoint_without_args_still_loads_its_weights_for_tools(tmp_path, megatron_log):
    """Generation (no optimizer) reads the weights; the missing args are mentioned."""
    root = tmp_path / "run"
    saved = _model(4)
    shard = _save(root, 2, saved)
    _rewrite(shard, lambda sd: {k: v for k, v in sd.items() if k != "args"})
    loaded = _model(99)
    assert _load(root, model=loaded) == (2, 0, 0)
    assert torch.equal(loaded.weight, saved.weight)
    assert any("holds no args" in r.getMessage() for r in megatron_log)


# ---------------------------------------------------------------------------------------------
# End to end through pretrain()
# ---------------------------------------------------------------------------------------------

SHAPE = {"seq": 16, "mbs": 1, "gbs": 2, "iters": 6}


@pytest.fixture(scope="module")
def saved_run(gpt2_corpus, tmp_path_factory) -> Path:
    """A run saved at iterations 2 and 4 (tracker 4) of a 6-iteration schedule."""
    root = tmp_path_factory.mktemp("faults") / "run"
    result = e2e.pooled(1, [{"argv": e2e.gpt_argv(gpt2_corpus, **SHAPE, extra=[
        "--save", root, "--save-interval", "2", "--exit-interval", "4"])}])[0][0]
    assert result["error"] is None and result["iteration"] == 4
    assert (root / TRACKER_FILENAME).read_text() == "4"
    return root


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_end_to_end_mistyped_load_and_checkpoint_without_args(gpt2_corpus, saved_run,
                                                             tmp_path):
    before = _digests(saved_run)
    argsless = tmp_path / "argsless"
    shutil.copytree(saved_run, argsless)
    _rewrite(_shard(argsless, 4), lambda sd: {k: v for k, v in sd.items() if k != "args"})

    def run(*extra):
        return {"argv": e2e.gpt_argv(gpt2_corpus, **SHAPE, extra=[str(a) for a in extra])}

    typo, no_load, refused, allowed, finetune = (r[0] for r in e2e.pooled(1, [
        run("--save", saved_run, "--save-interval", 2, "--load", f"{saved_run}_typo"),
        run("--save", saved_run, "--save-interval", 2),
        run("--load", argsless),
        run("--load", argsless, "--allow-resume-without-checkpoint-args"),
        run("--load", argsless, "--finetune", "--exit-interval", 2),
    ], expect_error=(CheckpointError,)))

    assert typo["error"] is not None and typo["history"] == []
    assert f"--load {saved_run}_typo holds no checkpoint" in typo["error"]
    assert f"--save {saved_run} already holds checkpoints" in typo["error"]
    assert no_load["error"] is not None and "no --load was given" in no_load["error"]
    assert _digests(saved_run) == before, "the refused runs touched the saved run"

    assert refused["error"] is not None, "resumed from a checkpoint without args"
    assert str(_shard(argsless, 4)) in refused["error"]
    assert "--allow-resume-without-checkpoint-args" in refused["error"]
    assert allowed["error"] is None and allowed["iteration"] == 6
    assert len(allowed["history"]) == 2
    assert finetune["error"] is None and finetune["iteration"] == 2
