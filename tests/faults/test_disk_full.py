"""A disk that fills up during a checkpoint save, on a real size-limited file system.

``--save`` on a small tmpfs (``mount -t tmpfs -o size=...``; skipped with the reason where
mounting is not permitted). A TP=2 job saves iteration 2, then stops before the first byte of
iteration 4's save (the fault suite's driver hook) while the test fills the disk to within
``ROOM`` bytes, less than one shard; then the save goes on and runs out of space for real
(``write(2)`` answers ENOSPC, on whichever rank gets there first).

Promised: the job ends (no hang) with an error naming the directory, the size needed and the
free space, and the flag to change; the previous checkpoint is bit-for-bit intact (its sha256
files verify) and still the tracker's target; no temporary file is left behind.

The unit-level version (a writer that fails half-way, any errno) is
``tests/training/test_checkpoint_faults.py``; this one proves it on a kernel's ENOSPC.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest

from megatron.checkpointing.files import verify_checksum
from tests.faults import harness as h

ROOM = 48 << 10  # bytes left free: less than one shard of the tiny model (~200 KiB)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs mounted under tmp_path (unmounted afterwards)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): "
                    f"{done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _fill(mount_point: Path, room: int) -> int:
    """Fill the file system until ``room`` bytes are left; returns the bytes left."""
    filler = mount_point / "filler"
    block = b"\0" * (64 << 10)
    with open(filler, "wb") as out:
        try:
            while True:
                out.write(block)
                out.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
    size = filler.stat().st_size
    os.truncate(filler, max(size - room, 0))
    return os.statvfs(mount_point).f_bavail * os.statvfs(mount_point).f_frsize


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_disk_full_during_a_save_names_the_path_and_keeps_the_previous_checkpoint(
        small_disk, tmp_path):
    save = small_disk / "run"
    go = tmp_path / "go"
    flags = h.tiny_gpt_flags(train_iters=6, extra=[
        "--tensor-model-parallel-size", 2, "--save", save, "--save-interval", 2])
    job = h.launch("pretrain_gpt.py", flags, tmp_path / "job.log", nproc=2,
                   hooks={"FAULT_PAUSE_IN_SAVE": "4:before", "FAULT_PAUSE_UNTIL": str(go)})
    try:
        job.wait_for("FAULT-HOOK paused in save")
        assert h.tracker(save) == 2
        before = _digests(save / "iter_0000002")
        free = _fill(small_disk, ROOM)
        assert free <= ROOM + (64 << 10), free
        go.touch()
        code = job.wait()
    finally:
        job.reap()
    text = job.text()
    assert code != 0, job.tail()
    failed = re.search(r"^\[rank (\d)\] failed: CheckpointError: (no space left on the device "
                       r"for checkpoint file .*)$", text, re.M)
    assert failed, job.tail()
    message = failed.group(2)
    assert re.search(rf"in {save}/iter_0000004/mp_rank_0\d: it needs about ", message), message
    assert re.search(r"free there", message) and "--save" in message, message
    # The previous checkpoint: still the target, untouched, verified by its own checksums.
    assert h.tracker(save) == 2
    assert _digests(save / "iter_0000002") == before
    for shard in (save / "iter_0000002").rglob("*.pt"):
        assert verify_checksum(shard), shard
    assert h.temp_files(save) == []
