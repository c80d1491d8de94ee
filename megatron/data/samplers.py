"""Megatron's pretraining batch samplers and the pretraining data-loader factory.

Both samplers yield, per data-parallel rank, lists of ``micro_batch_size`` sample indices, and
resume exactly from ``consumed_samples`` (the global count of samples already trained on, saved
in checkpoints), so a restarted run continues the same order.
"""

from __future__ import annotations

from typing import Iterator

import torch

from megatron.data.loader import build_data_loader


def _check(total: int, consumed: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
    if total <= 0:
        raise ValueError(f"no samples to load (dataset length {total})")
    if consumed >= total:
        raise ValueError(f"consumed_samples {consumed} >= dataset length {total}: nothing left")
    if micro_batch_size <= 0 or dp_size <= 0:
        raise ValueError(f"--micro-batch-size {micro_batch_size} and data-parallel size {dp_size} "
                         "must be positive")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} outside [0, {dp_size})")


class MegatronPretrainingSampler:
    """Sequential over ``[consumed_samples, total_samples)``: every ``mbs * dp`` consecutive
    indices form one global micro-batch, of which DP rank r takes slice ``[r*mbs, (r+1)*mbs)``.

    Args:
        total_samples: length of the dataset.
        consumed_samples: samples already consumed by all ranks together.
        micro_batch_size: samples per rank per micro-batch.
        data_parallel_rank: this rank's DP index.
        data_parallel_size: DP world size.
        drop_last: drop a last incomplete global micro-batch.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True) -> None:
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
               data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_micro_batch = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _mine(self, batch: list[int]) -> list[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start : start + self.micro_batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.global_micro_batch:
                yield self._mine(batch)
                batch = []
        if batch and not self.drop_last:
            yield self._mine(batch)


class MegatronPretrainingRandomSampler:
    """Cyclic sampler (``--dataloader-type cyclic``): each epoch a fresh random order seeded by
    the epoch number; every iteration continues from ``consumed_samples``.

    With data sharding (Megatron's default) each DP rank owns a contiguous bucket of the
    dataset and shuffles it with ``torch.randperm(bucket, generator=manual_seed(epoch))``.
    The last ``total % (mbs * dp)`` samples are left out of every epoch.
    """

    def __init__(self, dataset: torch.utils.data.Dataset | None, total_samples: int,
                 consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, data_sharding: bool = True) -> None:
        _check(total_samples, 0, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.global_micro_batch = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.global_micro_batch
        if total_samples < self.global_micro_batch:
            raise ValueError(f"dataset of {total_samples} samples is smaller than one global "
                             f"micro-batch ({self.global_micro_batch})")

    def __len__(self) -> int:
        return self.total_samples

    def _order(self, epoch: int, epoch_consumed: int) -> list[int]:
        g = torch.Generator()
        g.manual_seed(epoch)
        if self.data_sharding:
            bucket = (self.total_samples // self.global_micro_batch) * self.micro_batch_size
            start = self.data_parallel_rank * bucket
            perm = torch.randperm(bucket, generator=g, device="cpu").tolist()
            return [start + x for x in perm[epoch_consumed // self.data_parallel_size :]]
        full = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
        perm = torch.randperm(full, generator=g, device="cpu").tolist()[epoch_consumed:]
        return perm[self.data_parallel_rank :: self.data_parallel_size]

    def __iter__(self) -> Iterator[list[int]]:
        active = self.total_samples - self.last_batch_size
        epoch = self.consumed_samples // active
        epoch_consumed = self.consumed_samples % active
        if epoch_consumed % self.global_micro_batch:
            raise ValueError(f"consumed_samples {self.consumed_samples} is not a multiple of "
                             f"micro-batch x data-parallel size {self.global_micro_batch}")
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        batch: list[int] = []
        for idx in self._order(epoch, epoch_consumed):
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.global_micro_batch
                yield batch
                batch = []


def build_pretraining_data_loader(dataset: torch.utils.data.Dataset | None, consumed_samples: int,
                                  dataloader_type: str | None, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  num_workers: int = 2) -> torch.utils.data.DataLoader | None:
    """A DataLoader over ``dataset`` with Megatron's sampler for ``--dataloader-type``.

    Args:
        dataset: the split's dataset (None -> None).
        consumed_samples: samples already trained on (resume point).
        dataloader_type: "single" (default when None) or "cyclic".
        micro_batch_size: samples per rank per micro-batch.
        data_parallel_rank: this rank's DP index.
        data_parallel_size: DP world size.
        num_workers: --num-workers loader processes.

    Raises:
        ValueError: unknown --dataloader-type.
    """
    if dataset is None:
        return None
    kind = dataloader_type or "single"
    if kind == "single":
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                             data_parallel_rank, data_parallel_size)
    elif kind == "cyclic":
        sampler = MegatronPretrainingRandomSampler(dataset, len(dataset), consumed_samples,
                                                   micro_batch_size, data_parallel_rank,
                                                   data_parallel_size)
    else:
        raise ValueError(f"--dataloader-type {dataloader_type!r}: expected 'single' or 'cyclic'")
    return build_data_loader(dataset, sampler, num_workers=num_workers,
                             persistent_workers=num_workers > 0)
