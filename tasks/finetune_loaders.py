"""The finetuning loaders (part of :mod:`tasks.finetune_utils`, which re-exports them): the
shuffled, data-parallel-sharded, resumable training epochs and the in-order evaluation shares.
"""

from __future__ import annotations

import math

import torch

from megatron.core import parallel_state
from megatron.data.loader import build_data_loader


class EpochBatchSampler(torch.utils.data.Sampler):
    """This data-parallel rank's micro-batches (index lists) of one epoch.

    The epoch's order is ``torch.randperm(n)`` from ``seed + epoch`` (Megatron's
    ``DistributedSampler.set_epoch(seed + epoch)``; ``shuffle=False``: 0..n-1). Global batch
    ``i`` is ``order[i G:(i+1) G]`` (``G = mbs x dp x micro-batches``); micro-batch ``m`` of it
    is the next ``mbs x dp`` indices, of which DP rank ``r`` takes every ``dp``-th from ``r`` (as
    ``DistributedSampler``). ``drop_last``: the last partial global batch is dropped; otherwise
    (one micro-batch per step only) the order is padded by wrapping to a multiple of ``dp`` and
    the last batch is smaller. ``start_iteration`` skips whole global batches (resume).
    """

    def __init__(self, num_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, *,
                 num_microbatches: int = 1, seed: int = 0, epoch: int = 0,
                 shuffle: bool = True, drop_last: bool = True, start_iteration: int = 0) -> None:
        if not drop_last and num_microbatches != 1:
            raise ValueError("keeping the last partial batch needs one micro-batch per step")
        self.n, self.mbs, self.rank, self.dp = num_samples, micro_batch_size, dp_rank, dp_size
        self.nmb, self.seed, self.epoch = num_microbatches, seed, epoch
        self.shuffle, self.drop_last, self.start = shuffle, drop_last, start_iteration

    def iterations(self) -> int:
        """Global batches (optimizer steps) in one epoch."""
        if self.drop_last:
            return self.n // (self.mbs * self.dp * self.nmb)
        return math.ceil(math.ceil(self.n / self.dp) / self.mbs)

    def _order(self) -> list[int]:
        if not self.shuffle:
            order = list(range(self.n))
        else:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=generator, device="cpu").tolist()
        if not self.drop_last:
            pad = -len(order) % self.dp
            order += (order * (pad // max(1, len(order)) + 1))[:pad]
        return order

    def __iter__(self):
        order = self._order()
        micro = self.mbs * self.dp
        for step in range(self.start, self.iterations()):
            batch = order[step * micro * self.nmb:(step + 1) * micro * self.nmb]
            for m in range(self.nmb):
                yield batch[m * micro:(m + 1) * micro][self.rank::self.dp]

    def __len__(self) -> int:
        return (self.iterations() - self.start) * self.nmb


def make_loader(dataset, batch_sampler, collate_fn, num_workers: int):
    """A DataLoader over ``batch_sampler``'s index lists (``collate_fn`` None: torch's).

    Built by the project's one loader factory: its workers ignore the SIGTERM a scheduler sends
    the rank's process group, so --exit-signal-handler can still save (a fresh iterator, and
    fresh workers, every epoch).
    """
    return build_data_loader(dataset, batch_sampler, num_workers=num_workers,
                             collate_fn=collate_fn)


class _EvaluationSampler(torch.utils.data.Sampler):
    """Data-parallel rank ``r`` of ``dp`` takes samples ``r, r + dp, ...``, in order, in batches
    of ``micro_batch_size``; nothing dropped or repeated (counts stay exact)."""

    def __init__(self, num_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.mine = list(range(dp_rank, num_samples, dp_size))
        self.mbs = micro_batch_size

    def __iter__(self):
        for start in range(0, len(self.mine), self.mbs):
            yield self.mine[start:start + self.mbs]

    def __len__(self) -> int:
        return math.ceil(len(self.mine) / self.mbs)


def evaluation_loader(dataset, micro_batch_size: int, collate_fn=None, num_workers: int = 0):
    """This data-parallel rank's share of ``dataset`` for evaluation (call inside the callback,
    once process groups exist): every sample once over all DP ranks, in order."""
    sampler = _EvaluationSampler(len(dataset), micro_batch_size,
                                 parallel_state.get_data_parallel_rank(),
                                 parallel_state.get_data_parallel_world_size())
    return make_loader(dataset, sampler, collate_fn, num_workers)
