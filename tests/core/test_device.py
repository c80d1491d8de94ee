"""The host allocator tuning of ``megatron.core.device`` (CPU runs)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Allocates and frees a 64 MiB tensor 30 times (what every training step does with its
# activations and logits) and prints the minor page faults of the last ten rounds (the first
# rounds of the tuned heap grow it: each 64-byte-aligned request is a little larger than the
# block just freed, until freed neighbours merge).
_FAULTS_SCRIPT = """
import resource, sys, torch
from megatron.core import device
tuned = device.tune_host_allocator()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.ones(16 * 2**20).sum()
start = faults()
for _ in range(10):
    torch.ones(16 * 2**20).sum()
print(tuned, faults() - start)
"""


def _faults(tune: bool) -> tuple[bool, int]:
    env = {"MEGATRON_TUNE_HOST_MALLOC": "1" if tune else "0", "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="mallopt tuning applies to glibc on Linux only")
def test_tuned_allocator_reuses_freed_pages():
    """Untuned glibc maps and unmaps every 64 MiB block (16k page faults a round); tuned, the
    heap keeps the pages and once it has grown the rounds fault (almost) nothing."""
    tuned, tuned_faults = _faults(tune=True)
    untuned, untuned_faults = _faults(tune=False)
    assert tuned and not untuned
    assert untuned_faults > 10 * 16_384 * 0.9, untuned_faults  # 64 MiB = 16,384 pages a round
    assert tuned_faults < untuned_faults / 20, (tuned_faults, untuned_faults)
