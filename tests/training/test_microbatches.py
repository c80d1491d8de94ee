"""megatron/training/microbatches.py: the micro-batch calculator with and without batch-size
ramp-up, and the number of iterations that ramp-up gives --train-samples by Megatron's rule
(``pretrain.compute_train_iters``). Pure: no process group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron.training.microbatches import NumMicroBatchesCalculator
from megatron.training.pretrain import compute_train_iters


def test_microbatches_plain_and_rampup():
    assert NumMicroBatchesCalculator(32, 2, 4).get() == 4
    calc = NumMicroBatchesCalculator(32, 2, 2, ["8", "8", "300"])
    sizes = []
    for consumed in (0, 99, 100, 250, 300, 10_000):
        calc.update(consumed)
        sizes.append(calc.current_global_batch_size)
    assert sizes == [8, 8, 16, 24, 32, 32]
    with pytest.raises(ValueError, match="multiple"):
        NumMicroBatchesCalculator(32, 2, 2, ["6", "8", "300"])


def train_iters_cfg(train_samples, gbs, rampup=None, train_iters=None, mbs=1, dp=1):
    return SimpleNamespace(data_parallel_size=dp, training=SimpleNamespace(
        train_iters=train_iters, train_samples=train_samples, global_batch_size=gbs,
        micro_batch_size=mbs, rampup_batch_size=rampup))


@pytest.mark.parametrize("samples,gbs,rampup,expected", [
    (1000, 32, None, 31),  # 1000 // 32: the partial batch is dropped
    # Ramp-up 8 -> 32 by 8, one increment per 100 samples: 13 x 8 (to 104), 6 x 16 (to 200),
    # 5 x 24 (to 320: the batch at 296 <= 300 is still 24), then (1000 - 320) // 32 = 21.
    (1000, 32, ["8", "8", "300"], 13 + 6 + 5 + 21),
    (1015, 32, ["8", "8", "300"], 45),
    (1024, 32, ["8", "8", "300"], 46),
    # 2 -> 6 by 2 per 4 samples: 2, 2, 4, 6 (to 14), then (30 - 14) // 6 = 2.
    (30, 6, ["2", "2", "8"], 6),
    (310, 32, ["8", "8", "300"], 23),  # ends inside the last ramp-up batch (296 + 24 > 310)
    (100, 32, ["8", "8", "300"], 12),  # ends inside the ramp-up: 12 whole batches of 8
])
def test_train_iters_from_samples_as_megatron(samples, gbs, rampup, expected):
    assert compute_train_iters(train_iters_cfg(samples, gbs, rampup)) == expected


def test_train_iters_given():
    assert compute_train_iters(train_iters_cfg(None, 32, train_iters=7)) == 7
