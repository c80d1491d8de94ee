"""Real Megatron-Core reads what our MoE training writes: a ``--ckpt-format torch_dist``
checkpoint saved by ``pretrain_gpt.py`` at EP=2 x TP=2 (sequence parallel, 4 ranks) with each
expert split over ETP=2 ranks or whole on one (ETP=1), loaded by Megatron-Core 0.19.2 at the
same layout with ``dist_checkpointing.load`` into its own ``sharded_state_dict``, gives the
logits our model gives from that checkpoint (the ``ep_base`` model of
``tests/fixtures/mcore_moe``). Skipped where the Megatron-Core venv is absent."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from bench.launch import free_port
from megatron.checkpointing import checkpoint_dir
from tests.core.transformer.test_moe_mcore_models import TOL, _expert_parallel_run
from tests.multiprocess import run_distributed
from tests.training import e2e

MCORE_PYTHON = Path(os.environ.get("MCORE_PYTHON", "/tmp/mcore/venv/bin/python"))
pytestmark = pytest.mark.skipif(
    not MCORE_PYTHON.is_file(),
    reason=f"real Megatron-Core is not installed here ({MCORE_PYTHON}; build it with "
           "../shared/data/mcore/regen.sh or set MCORE_PYTHON)")
ITERS = 2

# tests/fixtures/mcore_moe's ep_base (its config.json) as pretrain_gpt.py flags.
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "64",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
         "--global-batch-size", "2", "--train-iters", str(ITERS), "--lr", "1e-2",
         "--seed", "1234", "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
         "--make-vocab-size-divisible-by", "64", "--use-cpu-initialization",
         "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1",
         "--distributed-backend", "gloo", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--num-experts", "4",
         "--moe-ffn-hidden-size", "24", "--moe-shared-expert-intermediate-size", "32",
         "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
         "--moe-token-dispatcher-type", "alltoall", "--tensor-model-parallel-size", "2",
         "--sequence-parallel", "--expert-model-parallel-size", "2",
         "--ckpt-format", "torch_dist", "--save-interval", str(ITERS)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("ours_moe")
    runs = [{"argv": [*FLAGS, "--expert-tensor-parallel-size", str(etp),
                      "--save", str(root / f"etp{etp}")]} for etp in (1, 2)]
    for per_rank in e2e.pooled(4, runs):
        assert per_rank[0]["error"] is None, per_rank[0]["error"]
    return {etp: checkpoint_dir(root / f"etp{etp}", ITERS) for etp in (1, 2)}


def test_real_megatron_core_loads_our_ep2_tp2_moe_checkpoints(saved, tmp_path):
    script = Path(__file__).with_name("mcore_load_our_moe.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1")
    out = tmp_path / "theirs.pt"
    pairs = [str(x) for etp, path in saved.items() for x in (etp, path)]
    done = subprocess.run(
        [str(MCORE_PYTHON), "-m", "torch.distributed.run", "--nproc_per_node", "4",
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script),
         str(out), *pairs], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(out, weights_only=True)
    assert sorted(theirs) == [1, 2]
    for etp, path in saved.items():
        ours = run_distributed(4, _expert_parallel_run, 2, etp, "alltoall", path)[0][0]
        assert theirs[etp]["iteration"] == ITERS
        torch.testing.assert_close(theirs[etp]["logits"], ours, atol=TOL, rtol=TOL)
