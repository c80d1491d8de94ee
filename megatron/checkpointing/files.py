"""Writing checkpoint files so that a crash never leaves a loadable-looking partial one, and
reading them back verified.

* Every file is written under the temporary name ``.<name>.tmp-<pid>``, synced, then renamed
  into place, and the directory holding it is synced (:func:`save_file`); the tracker is
  rewritten the same way (:func:`publish_tracker`), after the iteration directory and the root
  are synced, so it never points at a checkpoint a power loss could still take back. A process
  killed mid-save leaves its temporary file behind; :func:`remove_stale_temp_files` removes it
  (only names of that exact pattern, in the checkpoint layout's own directories).
* The sha256 of every shard file (``model_optim_rng.pt``, ``distrib_optim.pt``) is recorded in
  one manifest per iteration directory, ``iter_XXXXXXX/checksums.sha256`` in ``sha256sum``
  format (``<hex>  mp_rank_00/model_optim_rng.pt``; ``sha256sum -c checksums.sha256`` inside the
  iteration directory checks it by hand), written once every shard is in
  (:func:`write_manifest`). The ``mp_rank_*`` directories hold only what Megatron-LM's do: tools
  that load the first file they list there (HuggingFace's reshaping script) get a shard. The
  hash is taken from the bytes as they are written, so a save reads nothing back. Checkpoints
  saved before the manifest carry a ``<shard>.sha256`` beside each shard, still checked;
  Megatron-LM's, which have neither, have their zip CRC32s checked (:func:`verify_checksum`).
* A write that fails (a full disk above all) is reported with the directory, the bytes the state
  needs and the space left, not torch's bare ``basic_ios::clear: iostream error``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import os
import re
import shutil
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.safe_load import PICKLE_MODULE
from megatron.checkpointing.names import (  # noqa: F401 - the names of the files written here
    CHECKPOINT_FILENAMES, DISTRIB_OPTIM_FILENAME, ITERATION_DIR, MANIFEST_FILENAME,
    MODEL_FILENAME, SHARD_DIR, TRACKER_FILENAME, parse_tracker, tracker_path)

CHECKSUM_SUFFIX = ".sha256"
"""The suffix of the per-shard checksum files of checkpoints saved before the manifest."""
_READ_CHUNK = 8 << 20
_NO_SPACE = {errno.ENOSPC} | ({errno.EDQUOT} if hasattr(errno, "EDQUOT") else set())
_TEMP_NAME = re.compile(r"\.(?P<name>[\w.]+)\.tmp-\d+")


# Atomic writes ----------------------------------------------------------------------------------
def temp_path(path: Path) -> Path:
    """The name ``path`` is written under before the rename (per process, hidden)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _atomic_write(write: Callable[[Path], None], path: Path) -> None:
    """Write via ``write(tmp_path)``, fsync, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _fsync_dir(path: Path) -> None:
    """fsync a directory, so the renames and new entries in it survive a power loss.

    Skipped where directories cannot be opened (no ``os.O_DIRECTORY``, e.g. Windows) or synced
    (file systems answering EINVAL / ENOTSUP).
    """
    flag = getattr(os, "O_DIRECTORY", None)
    if flag is None:
        return
    fd = os.open(path, os.O_RDONLY | flag)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def save_file(obj, path: Path, flag: str = "--save") -> str:
    """``torch.save`` a shard file (``iter_X/mp_rank_YY/<name>``) atomically, then sync its
    directory (the renames are durable); returns the sha256 of the bytes written, for the
    iteration's manifest (:func:`write_manifest`, once every shard is in).

    The iteration directory's manifest goes first (and a ``.sha256`` of a save from before the
    manifest): a crash before the new manifest is written then leaves files without a checksum
    (loaded after a CRC check), never files with a stale one.

    Raises:
        CheckpointError: the write failed (out of space: naming the directory, the bytes needed
            and the bytes free).
    """
    digests: list[str] = []

    def write(tmp: Path) -> None:
        # Through a Python file object: a full disk surfaces as OSError(ENOSPC), not as
        # torch's "basic_ios::clear: iostream error".
        with open(tmp, "wb") as raw:
            out = HashingWriter(raw)
            try:
                torch.save(obj, out, pickle_module=PICKLE_MODULE)
            except RuntimeError:
                if out.error is not None:
                    raise out.error from None  # the disk's error, not torch's follow-up
                raise
        digests.append(out.hexdigest())

    with reported_write_errors(path, needed=lambda: state_nbytes(obj), flag=flag):
        manifest_path(path).unlink(missing_ok=True)
        checksum_path(path).unlink(missing_ok=True)
        _atomic_write(write, path)
        _fsync_dir(path.parent)
    return digests[-1]


def manifest_entry(path: Path) -> str:
    """A shard file's name in its iteration's manifest: ``mp_rank_YY/<name>``."""
    return f"{path.parent.name}/{path.name}"


def manifest_path(path: Path) -> Path:
    """The manifest of the iteration directory holding shard file ``path``."""
    return path.parent.parent / MANIFEST_FILENAME


def write_manifest(iteration_dir: Path, digests: Mapping[str, str],
                   flag: str = "--save") -> None:
    """Write the iteration directory's manifest (``{manifest_entry: sha256}``, every shard file
    of every rank) atomically and sync the directory. Called once, after every shard is saved.

    Raises:
        CheckpointError: the write failed.
    """
    text = "".join(f"{digests[name]}  {name}\n" for name in sorted(digests))
    manifest = iteration_dir / MANIFEST_FILENAME
    with reported_write_errors(manifest, needed=lambda: len(text), flag=flag):
        _atomic_write(lambda tmp: tmp.write_text(text), manifest)
        _fsync_dir(iteration_dir)


def publish_tracker(root: Path, iteration: int, iteration_dir: Path,
                    flag: str = "--save") -> tuple[int, bool] | None:
    """Point the tracker of ``root`` at ``iteration``, durably: the iteration directory and the
    root are synced first (its shard directories must already be), the root again after.

    Returns:
        What the tracker named before (None: no tracker, or an unreadable one being replaced).

    Raises:
        CheckpointError: the write failed.
    """
    tracker = tracker_path(root)
    try:
        previous = parse_tracker(tracker)
    except CheckpointError:
        previous = None
    for directory in (iteration_dir, root):
        _fsync_dir(directory)
    with reported_write_errors(tracker, needed=lambda: len(str(iteration)), flag=flag):
        _atomic_write(lambda tmp: tmp.write_text(str(iteration)), tracker)
    _fsync_dir(root)
    return previous


# Temporary files --------------------------------------------------------------------------------
def remove_stale_temp_files(root: Path, names: tuple[str, ...] = CHECKPOINT_FILENAMES
                            ) -> list[Path]:
    """Delete the temporary files an interrupted save left under ``root``; returns them.

    Only files named as :func:`temp_path` names one of ``names`` (or its checksum file) are
    touched, and only in the save root and its ``iter_*/mp_rank_*`` directories (the manifest's
    in the ``iter_*`` directories). The caller makes sure that no save is running meanwhile.
    """
    wanted = set(names) | {name + CHECKSUM_SUFFIX for name in names}
    directories = [(root, wanted)]
    for iteration_dir in _subdirs(root, ITERATION_DIR):
        directories.append((iteration_dir, wanted & {MANIFEST_FILENAME}))
        directories += [(shard_dir, wanted) for shard_dir in _subdirs(iteration_dir, SHARD_DIR)]
    removed = []
    for directory, ours in directories:
        for entry in _entries(directory):
            match = _TEMP_NAME.fullmatch(entry.name)
            if match and match.group("name") in ours and entry.is_file(follow_symlinks=False):
                Path(entry.path).unlink(missing_ok=True)
                removed.append(Path(entry.path))
    return removed


def _entries(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _subdirs(directory: Path, pattern: re.Pattern) -> list[Path]:
    return [Path(e.path) for e in _entries(directory)
            if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]


# Checksums --------------------------------------------------------------------------------------
class HashingWriter:
    """A binary file that hashes (sha256) every byte written through it, for ``torch.save``.

    ``error`` keeps the first ``OSError`` of the file: torch's writer replaces it with a
    RuntimeError of its own ("unexpected pos ...") while closing the archive.
    """

    def __init__(self, raw) -> None:
        self._raw = raw
        self._hash = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            count = self._raw.write(data)
        except OSError as err:
            self.error = self.error or err
            raise
        self._hash.update(data)
        return count

    def flush(self) -> None:
        self._raw.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def checksum_path(path: Path) -> Path:
    """The ``sha256sum``-format file beside checkpoint file ``path`` (checkpoints saved before
    the manifest)."""
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def checksum_text(digest: str, path: Path) -> str:
    return f"{digest}  {path.name}\n"


def verify_checksum(path: Path) -> bool:
    """Compare shard file ``path`` with the sha256 its iteration's manifest records (or, saved
    before the manifest, the ``.sha256`` beside it), reading the file once in chunks.

    Returns:
        True when it matches, False when no checksum is recorded (a Megatron-LM checkpoint:
        its zip CRC32s are checked instead).

    Raises:
        CheckpointError: the file differs from its checksum, or the checksum file is malformed.
    """
    recorded = _recorded_digest(path)
    if recorded is None:
        _verify_zip_crcs(path)
        return False
    expected, source = recorded
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_READ_CHUNK), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise CheckpointError(
            f"corrupt or truncated checkpoint file {path}: its sha256 is "
            f"{digest.hexdigest()}, but {source} recorded {expected} when it was saved "
            "(flipped bits, an incomplete copy, or a file rewritten by another tool). Restore it "
            "from a good copy, or pass --no-verify-checkpoint-checksums to load it anyway")
    return True


_SHA256SUM_LINE = re.compile(rb"([0-9a-fA-F]{64}) [ *](.+)")


def _recorded_digest(path: Path) -> tuple[str, Path] | None:
    """(sha256, the file recording it) of shard file ``path``: its manifest's line, else the
    ``.sha256`` beside it; None when neither records it."""
    manifest = manifest_path(path)
    try:
        lines = manifest.read_bytes().splitlines()
    except (FileNotFoundError, NotADirectoryError):
        lines = []
    for line in lines:
        match = _SHA256SUM_LINE.fullmatch(line.rstrip(b"\r"))
        if match is None:
            raise _malformed(manifest, "the sha256 of each shard file")
        if match.group(2).decode(errors="replace") == manifest_entry(path):
            return match.group(1).decode().lower(), manifest
    recorded = checksum_path(path)
    try:
        text = recorded.read_bytes()
    except FileNotFoundError:
        return None
    match = re.match(rb"([0-9a-fA-F]{64})\s", text)
    if match is None:
        raise _malformed(recorded, f"the sha256 of {path.name}")
    return match.group(1).decode().lower(), recorded


def _malformed(checksums: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"corrupt or truncated checkpoint file {checksums}: it should hold {what} in sha256sum "
        "format; delete it (or pass --no-verify-checkpoint-checksums) to load the checkpoint "
        "unverified")


def _verify_zip_crcs(path: Path) -> None:
    """A shard without a recorded sha256 (written by Megatron-LM): torch's zip format records a CRC32 of
    every entry, which torch's reader never checks (a flipped bit in a tensor loads silently);
    check them, reading the file once. The legacy non-zip format records nothing.

    Raises:
        CheckpointError: an entry's bytes disagree with its CRC32.
    """
    if not zipfile.is_zipfile(path):
        return  # legacy format, or a truncated zip (torch's loader names that one)
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, zlib.error) as err:
        raise CheckpointError(f"corrupt or truncated checkpoint file {path}: {err}") from err
    if bad is not None:
        raise CheckpointError(
            f"corrupt or truncated checkpoint file {path}: the bytes of its entry {bad} do not "
            "match the CRC32 recorded when it was saved (flipped bits, or an incomplete copy). "
            "Restore it from a good copy, or pass --no-verify-checkpoint-checksums to load it "
            "anyway")


# Write errors -----------------------------------------------------------------------------------
def state_nbytes(obj) -> int:
    """Bytes of tensor / array data in a state dict (each storage once): what a save needs,
    give or take the pickled structure."""
    seen: set = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes(), str(item.device))
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(item, np.ndarray):
            total += item.nbytes
        elif isinstance(item, dict):
            stack += item.values()
        elif isinstance(item, (list, tuple)):
            stack += item
        elif isinstance(item, argparse.Namespace):
            stack += vars(item).values()
    return total


@contextlib.contextmanager
def reported_write_errors(path: Path, needed: Callable[[], int] | None = None,
                          flag: str = "--save") -> Iterator[None]:
    """Turn an ``OSError`` while writing checkpoint file ``path`` into a CheckpointError naming
    the directory, the bytes ``needed()``, the free space there and ``flag``, the option that
    chose the directory (``--save``; the converter's ``--save-dir``): :func:`write_error`."""
    try:
        yield
    except OSError as err:
        raise write_error(err, path, needed() if needed is not None else None, flag) from err


def write_error(err: OSError, path: Path, needed: int | None,
                 flag: str = "--save") -> CheckpointError:
    directory = path.parent
    free = _free_bytes(directory)
    space = f"{_size(free)} free there" if free is not None else "free space unknown"
    if err.errno in _NO_SPACE:
        need = f"it needs about {_size(needed)}, " if needed else ""
        return CheckpointError(
            f"no space left on the device for checkpoint file {path.name} in {directory}: "
            f"{need}{space} ({err.strerror}). The previous checkpoint and the tracker are "
            f"untouched; free some space or point {flag} at a larger disk")
    return CheckpointError(f"could not write checkpoint file {path}: {err.strerror or err} "
                           f"({space})")


def _free_bytes(directory: Path) -> int | None:
    # The directory itself may not exist yet (mkdir is what failed): ask its nearest ancestor.
    for candidate in (directory, *directory.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"
