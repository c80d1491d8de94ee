"""Cache of dataset index arrays as ``.npy`` files, built once and shared by all ranks.

Names follow Megatron-Core: ``{cache_dir}/{md5}-{Class}-{split}-{description.txt|<name>.npy}``
where md5 is over the JSON description of the inputs, so Megatron-Core and this framework
find each other's caches when their descriptions agree.

Concurrency: with torch.distributed initialised, global rank 0 builds while the others wait at
a barrier and then load. Independent processes (several jobs sharing a cache directory) are
safe too: every file is written to a temporary name and renamed into place atomically, so a
reader sees either no file or a complete one; a process that misses rebuilds identical arrays.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import torch.distributed as dist

from megatron.core import comm
from megatron.core.log import log_rank_0


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
                  build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Load ``names`` from the cache, or build them (rank 0) and save them.

    Every rank must call this for the same caches in the same order when torch.distributed
    is initialised (one barrier per call).

    Args:
        cache_dir: directory of the cache; None builds in memory without saving.
        base: ``{md5}-{Class}-{split}``, the common file-name stem.
        description: the text written to ``{base}-description.txt``.
        names: array names; files ``{base}-{name}.npy``.
        build: returns ``{name: array}`` for every name.

    Returns:
        ``{name: array}``, loaded with ``mmap_mode='r'`` when cached.

    Raises:
        ValueError: the cache directory cannot be created or written (names --data-cache-path).
    """
    if cache_dir is None:
        return build()
    paths = {name: os.path.join(cache_dir, f"{base}-{name}.npy") for name in names}
    desc_path = os.path.join(cache_dir, f"{base}-description.txt")
    hit = all(os.path.isfile(p) for p in [desc_path, *paths.values()])
    built = None
    if not hit and _rank() == 0:
        t0 = time.time()
        built = build()
        _save_all(cache_dir, desc_path, description, paths, built)
        log_rank_0(f"> built and cached {base} indices in {time.time() - t0:.3f} s under {cache_dir}")
    if dist.is_initialized():
        comm.barrier()
    if built is not None:
        return built
    if not all(os.path.isfile(p) for p in paths.values()):
        # Another process has not finished (no torch.distributed): build our own identical copy.
        built = build()
        _save_all(cache_dir, desc_path, description, paths, built)
        return built
    log_rank_0(f"> loading cached {base} indices from {cache_dir}")
    return {name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()}


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
