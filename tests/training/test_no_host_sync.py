"""The per-step forward and backward make no host-device synchronisation in the project's code.

Under ``tests.sync_guard.HostSyncGuard`` (module docstring there) the schedule of short
``pretrain_gpt.py`` runs (the forward and backward of every micro-batch, with the data loader's
default attention mask) refuses ``.item()``, ``bool(tensor)``, ``torch.equal``, ``.cpu()`` and
the like from ``megatron/`` and the entry scripts. The optimizer step and the logging after it
sync by design (the gradient norm, the logged loss) and are outside the guarded region.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.sync_guard import REPO, HostSync, HostSyncGuard
from tests.training import e2e


def test_the_guard_names_a_sync_in_the_projects_code():
    fake = os.path.join(REPO, "megatron", "core", "models", "gpt.py")
    namespace: dict = {}
    exec(compile("import torch\n\ndef plain(mask, ref):\n    return torch.equal(mask, ref)\n\n"
                 "def truth(x):\n    return bool(x)\n", fake, "exec"), namespace)
    x = torch.ones(2, 2, dtype=torch.bool)
    with HostSyncGuard():
        with pytest.raises(HostSync, match=r"megatron/core/models/gpt\.py:4: equal waits"):
            namespace["plain"](x, x)
        with pytest.raises(HostSync, match=r"gpt\.py:7: __bool__ waits"):
            namespace["truth"](x.all())
        assert bool(x.all())  # the tests' own calls are not the project's


def _guarded_schedule_pretrains(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    from megatron.training import loop

    chosen = loop.get_forward_backward_func

    def guarded_choice():
        schedule = chosen()

        def guarded(*args, **kwargs):
            # The NCCL-rule checks of the test suite read descriptors back on the host; a
            # GPU run does not make them.
            saved = os.environ.pop("MEGATRON_CHECK_COLLECTIVES", None)
            try:
                with HostSyncGuard():
                    return schedule(*args, **kwargs)
            finally:
                if saved is not None:
                    os.environ["MEGATRON_CHECK_COLLECTIVES"] = saved
        return guarded

    loop.get_forward_backward_func = guarded_choice
    try:
        return e2e.run_pretrains(rank, world_size, runs)
    finally:
        loop.get_forward_backward_func = chosen


def test_forward_and_backward_make_no_host_sync(gpt2_corpus):
    from tests.multiprocess import run_distributed

    runs = [{"argv": e2e.gpt_argv(gpt2_corpus, tp=2, iters=3, extra=["--sequence-parallel"])},
            {"argv": e2e.gpt_argv(gpt2_corpus, iters=3,
                                  extra=["--pipeline-model-parallel-size", "2"])},
            {"argv": e2e.gpt_argv(gpt2_corpus, tp=2, iters=3, extra=[
                "--position-embedding-type", "rope", "--normalization", "RMSNorm",
                "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights"])}]
    per_rank = run_distributed(2, _guarded_schedule_pretrains, runs, timeout=300)
    for rank, results in enumerate(per_rank):
        for run, result in zip(runs, results):
            assert result["error"] is None, (rank, run["argv"][-6:], result["error"])
            assert len(result["history"]) == 3
