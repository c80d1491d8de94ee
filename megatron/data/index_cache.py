"""Cache of dataset index arrays as ``.npy`` files, built once and shared by all ranks.

Names follow Megatron-Core: ``{cache_dir}/{md5}-{Class}-{split}-{description.txt|<name>.npy}``
where md5 is over the JSON description of the inputs, so Megatron-Core and this framework
find each other's caches when their descriptions agree.

Concurrency: with torch.distributed initialised, global rank 0 builds while the others wait at
a barrier and then load. Independent processes (several jobs sharing a cache directory) are
safe too: every file is written to a temporary name and renamed into place atomically, so a
reader sees either no file or a complete one; a process that misses rebuilds identical arrays.

Staleness: the names describe the inputs, not the data, so re-making a dataset at the same
prefix leaves caches that no longer fit it. The caller's ``validate`` checks loaded arrays
against the current data (cheaply); rank 0 rebuilds a stale cache with a warning, and any
other rank that still loads a stale one raises an error naming the files to delete.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import torch.distributed as dist

from megatron.core import comm
from megatron.core.log import log_rank_0, warn_rank_0


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _atomic_save(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
    os.replace(tmp, path)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wt", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def cached_arrays(cache_dir: str | None, base: str, description: str, names: list[str],
                  build: Callable[[], dict[str, np.ndarray]],
                  validate: Callable[[dict[str, np.ndarray]], str | None] | None = None
                  ) -> dict[str, np.ndarray]:
    """Load ``names`` from the cache, or build them (rank 0) and save them.

    The file names only describe the inputs (prefix, split, seed, ...), not the data: after
    the dataset at the same prefix is re-made, a cache can be stale. ``validate`` checks
    loaded arrays against the current data; rank 0 rebuilds a stale cache in place (with a
    warning), and a rank that still finds it stale afterwards raises.

    Every rank must call this for the same caches in the same order when torch.distributed
    is initialised (one barrier per call).

    Args:
        cache_dir: directory of the cache; None builds in memory without saving.
        base: ``{md5}-{Class}-{split}``, the common file-name stem.
        description: the text written to ``{base}-description.txt``.
        names: array names; files ``{base}-{name}.npy``.
        build: returns ``{name: array}`` for every name.
        validate: returns None when loaded arrays fit the current data, else what is wrong.

    Returns:
        ``{name: array}``, loaded with ``mmap_mode='r'`` when cached.

    Raises:
        ValueError: the cache directory cannot be created or written (names --data-cache-path),
            or a cached array is unreadable or stale and was not rebuilt (names the files).
    """
    if cache_dir is None:
        return build()
    paths = {name: os.path.join(cache_dir, f"{base}-{name}.npy") for name in names}
    desc_path = os.path.join(cache_dir, f"{base}-description.txt")
    hit = all(os.path.isfile(p) for p in [desc_path, *paths.values()])
    built, checked = None, None
    if _rank() == 0:
        checked, stale = _check(paths, validate) if hit else (None, None)
        if stale is not None:
            warn_rank_0(f"dataset index cache {os.path.join(cache_dir, base)}-*.npy does not match "
                        f"the dataset ({stale}): the data changed since it was built; rebuilding it")
        if not hit or stale is not None:
            t0 = time.time()
            built = build()
            try:
                _save_all(cache_dir, desc_path, description, paths, built)
            except ValueError as err:
                if stale is None:
                    raise
                raise ValueError(f"dataset index cache {os.path.join(cache_dir, base)}-*.npy is "
                                 f"stale ({stale}) and cannot be rebuilt ({err}); delete those "
                                 "files and run again") from err
            log_rank_0(f"> built and cached {base} indices in {time.time() - t0:.3f} s "
                       f"under {cache_dir}")
    if dist.is_initialized():
        comm.barrier(comm.world_group())
    if built is not None:
        return built
    if checked is not None:  # rank 0, valid cache
        log_rank_0(f"> loading cached {base} indices from {cache_dir}")
        return checked
    if not all(os.path.isfile(p) for p in paths.values()):
        # Another process has not finished (no torch.distributed): build our own identical copy.
        built = build()
        _save_all(cache_dir, desc_path, description, paths, built)
        return built
    log_rank_0(f"> loading cached {base} indices from {cache_dir}")
    arrays, problem = _check(paths, validate)
    if problem is not None:
        raise ValueError(f"dataset index cache {os.path.join(cache_dir, base)}-*.npy does not "
                         f"match the dataset ({problem}); delete those files (or pass another "
                         "--data-cache-path) and run again")
    return arrays


def _load(paths: dict[str, str]) -> dict[str, np.ndarray]:
    return {name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()}


def _check(paths: dict[str, str], validate: Callable[[dict[str, np.ndarray]], str | None] | None
           ) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """The cached arrays and what is wrong with them (unreadable, or ``validate``'s answer)."""
    try:
        arrays = _load(paths)
    except (OSError, ValueError) as err:  # truncated or foreign .npy
        return None, f"unreadable: {err}"
    return arrays, validate(arrays) if validate is not None else None


def _save_all(cache_dir: str, desc_path: str, description: str, paths: dict[str, str],
              arrays: dict[str, np.ndarray]) -> None:
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for name, path in paths.items():
            _atomic_save(path, arrays[name])
        # The description goes last: its presence marks a complete set.
        _atomic_write_text(desc_path, description)
    except OSError as err:
        raise ValueError(f"cannot write dataset index cache in {cache_dir} ({err}); pass a "
                         "writable directory with --data-cache-path") from err
