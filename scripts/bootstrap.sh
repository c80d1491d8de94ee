#!/usr/bin/env bash
# Create ./.venv (if missing) and install the package with its test extras.
# On the CPU machines this project is developed on, torch is pinned to the local CPU wheel
# (torch==2.13.0) so nothing downloads a multi-GB CUDA build; set TORCH_SPEC to override,
# e.g. TORCH_SPEC="torch" on a GPU machine whose index serves CUDA builds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" 2>/dev/null; then
  "$VPY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
stamp=.venv/.megatron-installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
   || [ -n "$(find megatron \( -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \) \
              -newer "$stamp" 2>/dev/null)" ]; then
  # The fused kernels are torch extensions: they build against the venv's torch, so no build
  # isolation (an isolated build has no torch, and would skip them: the PyTorch fallback).
  "$VPY" -m pip install -q setuptools wheel "pybind11>=2.10"
  "$VPY" -m pip install -q --no-build-isolation -e ".[test]"
  touch "$stamp"
  echo "installed into .venv: run 'source .venv/bin/activate' (or use .venv/bin/python and" \
       ".venv/bin/torchrun) before the python/torchrun commands of the docs"
fi
