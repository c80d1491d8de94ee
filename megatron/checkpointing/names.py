"""Names of a Megatron-LM checkpoint on disk (``--ckpt-format torch``; docs/FORMATS.md 2d)::

    <root>/latest_checkpointed_iteration.txt        the tracker: an iteration number, or "release"
    <root>/iter_0000100/mp_rank_00/model_optim_rng.pt         PP == 1: mp_rank_{tp:02d}
    <root>/iter_0000100/mp_rank_01_002/model_optim_rng.pt     PP > 1: mp_rank_{tp:02d}_{pp:03d}
    <root>/iter_0000100/mp_rank_00_001/model_optim_rng.pt     EP > 1: mp_rank_{tp:02d}[_{pp:03d}]_{ep:03d}
    <root>/iter_0000100/mp_rank_00/distrib_optim.pt           --use-distributed-optimizer
    <root>/iter_0000100/checksums.sha256            ours only: the sha256 of every shard file
    <root>/release/mp_rank_00/model_optim_rng.pt              a "release" checkpoint

Pure functions of their arguments: nothing here asks a process group for a rank.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from megatron.checkpointing.errors import CheckpointError, corrupt_file_error

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"
RELEASE_DIRNAME = "release"
MANIFEST_FILENAME = "checksums.sha256"
"""The iteration directory's checksums, ``sha256sum`` format, one line per shard file
(``<hex>  mp_rank_00/model_optim_rng.pt``). Not inside the ``mp_rank_*`` directories: tools
(HuggingFace's reshaping script) load the first entry they list there."""
CHECKPOINT_FILENAMES = (MODEL_FILENAME, DISTRIB_OPTIM_FILENAME, TRACKER_FILENAME,
                        MANIFEST_FILENAME)
"""Every file a save writes (the names an interrupted save's temporary files carry)."""

ITERATION_DIR = re.compile(r"iter_\d{7,}|release")
"""Names of the per-iteration directories (``iter_{:07d}``; more digits past 9,999,999)."""
SHARD_DIR = re.compile(r"mp_rank_(?P<tp>\d{2})(?:_(?P<pp>\d{3}))?(?:_(?P<ep>\d{3}))?")
"""``mp_rank_XX[_YYY[_ZZZ]]``: TP rank, PP rank (PP > 1), expert-parallel rank (v0.13)."""


def checkpoint_dir(root: str | os.PathLike, iteration: int, release: bool = False) -> Path:
    """``<root>/iter_{iteration:07d}`` (or ``<root>/release``)."""
    return Path(root) / (RELEASE_DIRNAME if release else f"iter_{iteration:07d}")


def shard_dir_name(tensor_rank: int, pipeline_rank: int = 0,
                   pipeline_parallel: bool = False, expert_rank: int = 0,
                   expert_parallel: bool = False) -> str:
    """``mp_rank_{tp:02d}``, or ``mp_rank_{tp:02d}_{pp:03d}`` when the checkpoint has several
    pipeline stages (the PP rank is in the name then, even for stage 0), then ``_{ep:03d}``
    with expert parallelism (Megatron-LM's ``get_checkpoint_name``)."""
    return f"mp_rank_{tensor_rank:02d}" + (f"_{pipeline_rank:03d}" if pipeline_parallel else "") \
        + (f"_{expert_rank:03d}" if expert_parallel else "")


def checkpoint_name(root: str | os.PathLike, iteration: int, release: bool = False, *,
                    tensor_rank: int = 0, pipeline_rank: int = 0,
                    pipeline_parallel: bool = False, expert_rank: int = 0,
                    expert_parallel: bool = False) -> Path:
    """Path of one shard's ``model_optim_rng.pt``."""
    return checkpoint_dir(root, iteration, release) / \
        shard_dir_name(tensor_rank, pipeline_rank, pipeline_parallel, expert_rank,
                       expert_parallel) / MODEL_FILENAME


def tracker_path(root: str | os.PathLike) -> Path:
    """``<root>/latest_checkpointed_iteration.txt``."""
    return Path(root) / TRACKER_FILENAME


def parse_tracker(tracker: Path) -> tuple[int, bool] | None:
    """(iteration, release) from the tracker file; None without one (release reads as 0).

    Raises:
        CheckpointError: anything but a non-negative iteration number or "release".
    """
    try:
        raw = tracker.read_bytes()
    except FileNotFoundError:
        return None
    expected = "it should hold an iteration number or 'release'"
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise corrupt_file_error(tracker, f"{expected}, found bytes {raw[:20]!r}") from None
    if text == RELEASE_DIRNAME:
        return 0, True
    if not re.fullmatch(r"\d+", text):
        raise corrupt_file_error(tracker, f"{expected}, found {text[:50]!r}")
    return int(text), False


def latest_checkpoint_dir(root: str | os.PathLike) -> Path | None:
    """The iteration directory the tracker of ``root`` names; None without a tracker."""
    tracked = parse_tracker(tracker_path(root))
    return None if tracked is None else checkpoint_dir(root, *tracked)


def shard_files(iteration_dir: Path) -> dict[tuple[int, int], Path]:
    """Every ``model_optim_rng.pt`` of an iteration directory, by (TP rank, PP rank), sorted;
    the PP rank is 0 in checkpoints with one pipeline stage (no PP rank in the name).

    Raises:
        CheckpointError: an expert-parallel shard (``mp_rank_XX_YYY_ZZZ``), whose layout this
            package does not describe.
    """
    found = {}
    for path in sorted(iteration_dir.glob(f"mp_rank_*/{MODEL_FILENAME}")):
        match = SHARD_DIR.fullmatch(path.parent.name)
        if match is None:
            continue
        if match.group("ep") is not None:
            raise CheckpointError(f"{path}: expert-parallel shards (mp_rank_XX_YYY_ZZZ) are "
                                  "not supported")
        found[(int(match.group("tp")), int(match.group("pp") or 0))] = path
    return found


def any_shard_file(iteration_dir: Path) -> Path | None:
    """The first ``mp_rank_*/model_optim_rng.pt`` of an iteration directory (every shard holds
    the args), whatever its layout; None without one."""
    found = sorted(path for path in iteration_dir.glob(f"mp_rank_*/{MODEL_FILENAME}")
                   if SHARD_DIR.fullmatch(path.parent.name))
    return found[0] if found else None


def expert_shard_files(iteration_dir: Path, pipeline_parallel: bool, expert_parallel: bool
                       ) -> dict[tuple[int, int, int], Path]:
    """Every ``model_optim_rng.pt`` of an iteration directory, by (TP, PP, EP rank), sorted.

    ``mp_rank_00_001`` is PP rank 1 of a pipeline-parallel checkpoint and EP rank 1 of an
    expert-parallel one with one stage: the checkpoint's args (``pipeline_parallel``,
    ``expert_parallel``: its sizes > 1) say which.

    Raises:
        CheckpointError: a shard directory named for another layout (files of two layouts
            mixed in one iteration directory).
    """
    parts = 1 + pipeline_parallel + expert_parallel
    found = {}
    for path in sorted(iteration_dir.glob(f"mp_rank_*/{MODEL_FILENAME}")):
        if SHARD_DIR.fullmatch(path.parent.name) is None:
            continue
        ranks = [int(part) for part in path.parent.name[len("mp_rank_"):].split("_")]
        if len(ranks) != parts:
            raise CheckpointError(
                f"{path.parent} does not name a shard of this checkpoint's layout (pipeline "
                f"parallel: {pipeline_parallel}, expert parallel: {expert_parallel}, as its "
                "args record): files of two layouts mixed in one directory")
        tp = ranks[0]
        pp = ranks[1] if pipeline_parallel else 0
        ep = ranks[-1] if expert_parallel else 0
        found[(tp, pp, ep)] = path
    return found
