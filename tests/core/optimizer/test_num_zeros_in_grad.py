"""``--log-num-zeros-in-grad`` counts the zero gradient elements exactly.

TP=2 x DP=2 (4 ranks), a model whose gradients have a known number of zeros: a TP-split weight
with different zeros on each TP rank (both counted), a replicated LayerNorm-like weight and an
embedding with unused rows (replicated over TP: counted once, not twice), and a ``shared``
duplicate (counted nowhere). The count must be exact with the ordinary and the distributed
optimizer (whose grads are sharded over DP, and whose buffer padding must not count), fp32 and
bf16.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.multiprocess import run_distributed

VOCAB, DIM = 8, 3
USED_TOKENS = (1, 3, 3)  # rows 1 and 3 get gradients; the other 6 rows are zero


def _split_grad(tp_rank: int) -> torch.Tensor:
    grad = torch.arange(1.0, 13.0).view(3, 4)
    zeros = [(0, 0), (1, 2), (2, 3)] if tp_rank == 0 else [(2, 0)]
    for row, col in zeros:
        grad[row, col] = 0.0
    return grad


NORM_GRAD = torch.tensor([0.5, 0.0, 2.0, 0.0, 1.0])
EXPECTED = (3 + 1          # the split weight: 3 zeros on TP rank 0, 1 on TP rank 1
            + 2            # the replicated norm weight, once
            + (VOCAB - 2) * DIM)  # unused embedding rows, once


class _KnownZeros(torch.nn.Module):
    def __init__(self, tp_rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp_rank = tp_rank
        self.split = torch.nn.Parameter(torch.ones(3, 4, dtype=dtype))
        self.split.tensor_model_parallel, self.split.partition_dim = True, 0
        self.norm = torch.nn.Parameter(torch.ones(5, dtype=dtype))
        self.norm.tensor_model_parallel = False
        self.embedding = torch.nn.Embedding(VOCAB, DIM, dtype=dtype)
        self.embedding.weight.tensor_model_parallel = False
        self.dup = torch.nn.Parameter(torch.ones(2, 3, dtype=dtype))
        self.dup.tensor_model_parallel, self.dup.shared = False, True

    def forward(self) -> torch.Tensor:
        dtype = self.split.dtype
        rows = self.embedding(torch.tensor(USED_TOKENS))  # [3, DIM]
        return ((self.split * _split_grad(self.tp_rank).to(dtype)).sum()
                + (self.norm * NORM_GRAD.to(dtype)).sum()
                + rows.sum() + self.dup.sum() * 0.0)  # the duplicate's grad is all zeros


def _count(rank, world_size):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dp, mp = parallel_state.get_data_parallel_group(), parallel_state.get_model_parallel_group()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for distopt in (False, True):
            model = _KnownZeros(tp_rank, dtype)
            config = DistributedDataParallelConfig(accumulate_allreduce_grads_in_fp32=True,
                                                   use_distributed_optimizer=distopt)
            ddp = DistributedDataParallel(model, config, dp_group=dp)
            opt = get_megatron_optimizer(
                OptimizerConfig(lr=0.1, clip_grad=1.0, weight_decay=0.0,
                                bf16=dtype == torch.bfloat16, params_dtype=dtype,
                                use_distributed_optimizer=distopt, log_num_zeros_in_grad=True),
                [ddp], dp_group=dp, mp_group=mp)
            counts = []
            for _ in range(2):  # the second step's count is not polluted by the first
                ddp.zero_grad_buffer()
                opt.zero_grad()
                ddp().backward()
                ddp.finish_grad_sync()
                ok, _, zeros = opt.step()
                assert ok
                counts.append(zeros)
            out[(str(dtype), distopt)] = counts
    return out


@pytest.fixture(scope="module")
def counts():
    return run_distributed(4, _count)


@pytest.mark.parametrize("distopt", [False, True])
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_num_zeros_counts_known_zeros_once(counts, dtype, distopt):
    for rank, per_variant in enumerate(counts):
        assert per_variant[(dtype, distopt)] == [EXPECTED, EXPECTED], (rank, per_variant)
