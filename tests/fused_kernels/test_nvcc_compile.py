"""The CUDA kernels compile with nvcc alone (no torch, no GPU): csrc/cuda/fused_kernels.cuh
depends only on CUDA, and csrc/cuda/instantiate_all.cu instantiates every launcher for fp32,
fp16 and bf16. Skips, with the reason, where no nvcc is found (PATH, CUDA_HOME, or PyPI's
nvidia-cuda-nvcc in this environment, whose headers come with nvidia-cuda-runtime and
nvidia-cuda-cccl)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[2] / "megatron" / "fused_kernels" / "csrc" / "cuda"


def _nvcc() -> str | None:
    candidates = [shutil.which("nvcc")]
    if os.environ.get("CUDA_HOME"):
        candidates.append(str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"))
    # PyPI's nvidia-cuda-nvcc wheel: site-packages/nvidia/cuda_nvcc/bin/nvcc
    for site in sys.path:
        candidates.append(str(Path(site) / "nvidia" / "cuda_nvcc" / "bin" / "nvcc"))
    return next((c for c in candidates if c and Path(c).is_file() and os.access(c, os.X_OK)),
                None)


def _pypi_include_dirs(nvcc: str) -> list[str]:
    """The header folders of PyPI's CUDA wheels next to a wheel's nvcc (none for a toolkit)."""
    nvidia = Path(nvcc).parents[2]
    if nvidia.name != "nvidia":
        return []
    dirs = [nvidia / pkg / "include" for pkg in ("cuda_runtime", "cuda_cccl", "cuda_nvcc")]
    return [f"-I{d}" for d in dirs if d.is_dir()]


def test_cuda_kernels_compile_with_nvcc(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, CUDA_HOME, or pip install nvidia-cuda-nvcc-cu12 "
                    "nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12)")
    cmd = [nvcc, "-std=c++17", "-arch=sm_80", "-c", str(CUDA_DIR / "instantiate_all.cu"),
           "-o", str(tmp_path / "instantiate_all.o"), *_pypi_include_dirs(nvcc)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "instantiate_all.o").stat().st_size > 0
    # Every dtype was instantiated: the object holds the bf16 and fp16 launchers.
    names = subprocess.run(["nm", "-C", str(tmp_path / "instantiate_all.o")],
                           capture_output=True, text=True).stdout if shutil.which("nm") else ""
    if names:
        for dtype in ("float", "__half", "__nv_bfloat16"):
            assert f"launch_layer_norm_backward<{dtype}>" in names, dtype
            assert f"launch_rms_norm_backward<{dtype}>" in names, dtype
