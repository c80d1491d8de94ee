"""Training and generation steps make no device-less tensor in the project's code.

Under ``tests.device_guard.DeviceGuard`` (module docstring there), short runs of the trainer go
through forward, backward, gradient finalisation, the optimizer with clipping, the zero count and
the parameter norm, the distributed optimizer, pipeline p2p and evaluation, and the generation
loop runs with and without the KV cache. Any factory on those paths without a device, whichever
way it is reached, fails the test with its file and line. ``tests/test_device_placement.py``
scans the source for the same rule.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.device_guard import REPO, DeviceGuard, DeviceLessFactory
from tests.training import e2e


def test_the_guard_names_a_device_less_factory_in_the_projects_code():
    # A function whose code lives, as far as Python knows, in megatron/core/optimizer/.
    fake = os.path.join(REPO, "megatron", "core", "optimizer", "clip_grads.py")
    namespace: dict = {}
    exec(compile("import torch\n\ndef norm():\n    return torch.zeros(1, dtype=torch.float32)\n",
                 fake, "exec"), namespace)
    with DeviceGuard(), pytest.raises(DeviceLessFactory,
                                      match=r"megatron/core/optimizer/clip_grads\.py:4: "
                                            r"torch\.zeros without a device"):
        namespace["norm"]()
    with DeviceGuard():  # torch's own factories and the tests' are not the project's
        torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]).step()
        assert torch.zeros(1).device.type == "cpu"


def _guarded_pretrains(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    with DeviceGuard():
        return e2e.run_pretrains(rank, world_size, runs)


def test_training_steps_make_every_tensor_on_a_named_device(gpt2_corpus):
    from tests.multiprocess import run_distributed

    every_step = ["--clip-grad", "1.0", "--log-num-zeros-in-grad", "--log-params-norm",
                  "--eval-interval", "2", "--eval-iters", "1"]
    runs = [{"argv": e2e.gpt_argv(gpt2_corpus, tp=2, iters=3, extra=every_step)},
            {"argv": e2e.gpt_argv(gpt2_corpus, iters=3,
                                  extra=[*every_step, "--use-distributed-optimizer"])},
            {"argv": e2e.gpt_argv(gpt2_corpus, iters=3, extra=[
                *every_step, "--pipeline-model-parallel-size", "2"])}]
    per_rank = run_distributed(2, _guarded_pretrains, runs, timeout=300)
    for rank, results in enumerate(per_rank):
        for run, result in zip(runs, results):
            assert result["error"] is None, (rank, run["argv"][-6:], result["error"])
            assert len(result["history"]) == 3


@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_generation_steps_make_every_tensor_on_a_named_device(use_kv_cache):
    from megatron.text_generation import generate_tokens
    from tests.text_generation.tiny import MAX_POSITIONS, tiny_model

    model = tiny_model(dtype=torch.float32)
    with DeviceGuard(), torch.no_grad():
        out = generate_tokens(model, [[1, 2, 3], [4, 5]], 6, eod=256, vocab_size=257,
                              max_sequence_length=MAX_POSITIONS, top_k=3, seed=7,
                              use_kv_cache=use_kv_cache)
    assert [len(t) for t in out] == [9, 8]
