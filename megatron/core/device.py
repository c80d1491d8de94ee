"""The one place that decides where tensors live and which collective backend is used.

CUDA is used when it is available (NCCL backend); otherwise everything runs on the CPU with
gloo. Nothing else in the library calls ``torch.cuda`` directly, except ``tensor_parallel/random.py``
(RNG state) and ``fused_kernels/``.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import platform

import torch
import torch.distributed as dist


def accelerator_available() -> bool:
    """True when a CUDA device can be used."""
    return torch.cuda.is_available()


def get_device() -> torch.device:
    """The device this process computes on: its local CUDA device, or the CPU."""
    if accelerator_available():
        return torch.device("cuda", torch.cuda.current_device())  # cuda-only
    return torch.device("cpu")


def default_backend() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if accelerator_available() else "gloo"


def synchronize() -> None:
    """Wait for queued device work (a no-op on the CPU); used by timers."""
    if accelerator_available():
        torch.cuda.synchronize()  # cuda-only


def empty_cache() -> None:
    """Return cached device memory to the driver (a no-op on the CPU)."""
    if accelerator_available():
        torch.cuda.empty_cache()


def accelerator_rng_state() -> torch.Tensor | None:
    """The CUDA generator's state (checkpoints store it as ``cuda_rng_state``); None on the CPU."""
    return torch.cuda.get_rng_state() if accelerator_available() else None


def set_accelerator_rng_state(state: torch.Tensor | None) -> None:
    """Restore :func:`accelerator_rng_state` output (ignored on the CPU or when None)."""
    if accelerator_available() and state is not None:
        torch.cuda.set_rng_state(state)


def memory_stats() -> dict[str, float]:
    """Allocated / reserved / peak device memory in MiB (empty on the CPU)."""
    if not accelerator_available():
        return {}
    mib = 1024.0 * 1024.0
    return {
        "mem-allocated-MiB": torch.cuda.memory_allocated() / mib,
        "mem-reserved-MiB": torch.cuda.memory_reserved() / mib,
        "mem-max-allocated-MiB": torch.cuda.max_memory_allocated() / mib,
    }


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_HOST_ALLOCATOR_ENV = "MEGATRON_TUNE_HOST_MALLOC"
_host_allocator_tuned = False


def tune_host_allocator() -> bool:
    """Make glibc keep freed host memory for reuse instead of returning it to the kernel.

    By default glibc serves every block above 32 MiB with a fresh ``mmap`` and unmaps it on
    free, so each training step page-faults (and the kernel zeroes) every large activation,
    logits and gradient tensor again: about 2 GiB of faults per step for a 2-layer GPT-2-small
    on CPU, a third of the step. With mmap off and trimming raised, the heap keeps those pages
    and later steps reuse them (PyTorch's CPU tuning guide recommends jemalloc/tcmalloc for
    the same reason; this needs no extra library). The cost is that the process keeps its peak
    host memory. Set ``MEGATRON_TUNE_HOST_MALLOC=0`` to leave the allocator alone.

    Returns:
        True if the allocator was tuned (glibc on Linux, not disabled), else False.
    """
    global _host_allocator_tuned
    if _host_allocator_tuned:
        return True
    if os.environ.get(_HOST_ALLOCATOR_ENV, "1") == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; the threshold is an int, so 2 GiB is the most it takes.
    _host_allocator_tuned = bool(mallopt(_M_MMAP_MAX, 0)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _host_allocator_tuned


def init_distributed(backend: str | None = None, timeout_minutes: float = 10.0) -> None:
    """Initialize torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_*).

    A single process started without torchrun gets a world of one on 127.0.0.1, so scripts run
    unchanged with ``python pretrain_gpt.py ...``.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; ``None`` picks by device (NCCL needs CUDA).
        timeout_minutes: collective timeout.

    Raises:
        ValueError: NCCL asked for on a machine without CUDA.
    """
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    if backend == "nccl" and not accelerator_available():
        raise ValueError(
            "--distributed-backend nccl needs CUDA, which this machine lacks; use "
            "--distributed-backend gloo (the default on CPU)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    else:
        tune_host_allocator()  # before the model and its activations are allocated
    global _collective_timeout
    _collective_timeout = datetime.timedelta(minutes=timeout_minutes)
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                            timeout=_collective_timeout)


_collective_timeout: datetime.timedelta | None = None


def collective_timeout() -> datetime.timedelta | None:
    """The timeout :func:`init_distributed` gave the world group (None before, or when
    torch.distributed was started elsewhere: torch's default then)."""
    return _collective_timeout


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
