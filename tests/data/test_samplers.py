"""Pretraining samplers: DP slicing, resume from consumed_samples, the DataLoader factory."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron.data.samplers import (MegatronPretrainingRandomSampler, MegatronPretrainingSampler,
                                    build_pretraining_data_loader)


def _single(total, consumed, mbs, dp):
    return [list(MegatronPretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]


def test_single_dp_slices_cover_global_batches():
    total, mbs, dp = 103, 4, 3
    per_rank = _single(total, 0, mbs, dp)
    steps = len(per_rank[0])
    assert steps == total // (mbs * dp)
    for step in range(steps):
        joined = list(itertools.chain(*(per_rank[r][step] for r in range(dp))))
        assert joined == list(range(step * mbs * dp, (step + 1) * mbs * dp))


def test_single_resume_is_continuation():
    total, mbs, dp = 100, 2, 2
    full = _single(total, 0, mbs, dp)
    resumed = _single(total, 3 * mbs * dp, mbs, dp)
    for r in range(dp):
        assert resumed[r] == full[r][3:]
    last = list(MegatronPretrainingSampler(10, 0, 4, 0, 2, drop_last=False))
    assert last == [[0, 1, 2, 3], [8, 9]]


def _cyclic(total, consumed, mbs, dp, rank, n):
    sampler = MegatronPretrainingRandomSampler(None, total, consumed, mbs, rank, dp)
    out = []
    while len(out) < n:
        out.extend(sampler)  # each pass is one epoch; consumed_samples advances
    return out[:n]


@pytest.mark.parametrize("sharding", [True, False])
def test_cyclic_epochs_and_dp(sharding):
    total, mbs, dp = 50, 3, 2
    gmb = mbs * dp
    epoch_batches = (total - total % gmb) // gmb
    samplers = [MegatronPretrainingRandomSampler(None, total, 0, mbs, r, dp, data_sharding=sharding)
                for r in range(dp)]
    seen = [idx for s in samplers for b in s for idx in b]
    assert len(seen) == len(set(seen)) == epoch_batches * gmb  # disjoint, no repeats in an epoch
    second = [idx for s in samplers for b in s for idx in b]
    assert sorted(second) == sorted(seen) and second != seen  # reshuffled next epoch


def test_cyclic_resume_is_continuation():
    total, mbs, dp = 64, 4, 2
    for rank in range(dp):
        full = _cyclic(total, 0, mbs, dp, rank, 30)
        resumed = _cyclic(total, 5 * mbs * dp, mbs, dp, rank, 25)
        assert resumed == full[5:]
        across_epoch = _cyclic(total, 11 * mbs * dp, mbs, dp, rank, 19)
        assert across_epoch == full[11:]


class _Toy(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return {"tokens": torch.full((5,), i), "loss_mask": torch.ones(5)}


def test_data_loader_factory():
    loader = build_pretraining_data_loader(_Toy(), 8, "single", 4, 1, 2, num_workers=0)
    first = next(iter(loader))
    assert first["tokens"].shape == (4, 5) and first["tokens"][:, 0].tolist() == [12, 13, 14, 15]
    cyc = build_pretraining_data_loader(_Toy(), 0, "cyclic", 4, 0, 2, num_workers=0)
    assert next(iter(cyc))["tokens"].shape == (4, 5)
    assert build_pretraining_data_loader(None, 0, None, 4, 0, 1) is None
    with pytest.raises(ValueError, match="dataloader-type"):
        build_pretraining_data_loader(_Toy(), 0, "external", 4, 0, 1)


def test_data_loader_leaves_the_default_rng_alone():
    """Starting an iterator must not draw from the default torch generator: on the CPU that is
    the dropout stream, restored from checkpoints before the iterators are built."""
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    for kind in ("single", "cyclic"):
        next(iter(build_pretraining_data_loader(_Toy(), 0, kind, 4, 0, 1, num_workers=0)))
    assert torch.equal(torch.rand(3), expected)
