"""pretrain_gpt.py with one injected fault, for the fail-fast tests (run as a script).

    python tests/training/fail_fast_driver.py FAULT RANK ITERATION -- <pretrain_gpt.py flags>

On global rank RANK, at training iteration ITERATION (counted from 1), FAULT is:

* ``raise``: the forward step raises (an error in the training process);
* ``corrupt``: the dataset raises inside a loader worker from that iteration's samples on (a
  corrupt sample; needs ``--num-workers`` > 0);
* ``kill-worker``: one loader worker is SIGKILLed, as the OOM killer does;
* ``exit``: the rank vanishes (``os._exit(3)``) without a word, as a crashed process does;
* ``hang``: the rank stops (sleeps) after writing ``hanging``, as a stuck process does: its
  peers block in their next collective.

The run goes through ``fault.run_rank`` exactly as ``pretrain_gpt.py``'s own ``__main__``.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pretrain_gpt  # noqa: E402
from megatron.training import fault  # noqa: E402
from megatron.training.pretrain import pretrain  # noqa: E402


class InjectedFailure(RuntimeError):
    """The error the driver injects."""


class _CorruptFrom:
    """A dataset whose samples from ``first_bad`` on raise (on the faulty rank only)."""

    def __init__(self, dataset, first_bad: int) -> None:
        self.dataset, self.first_bad = dataset, first_bad

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int):
        if idx >= self.first_bad:
            raise InjectedFailure(f"corrupt sample {idx}")
        return self.dataset[idx]


def main(argv: list[str]) -> None:
    kind, fault_rank, iteration = argv[0], int(argv[1]), int(argv[2])
    flags = argv[argv.index("--") + 1:]
    faulty = int(os.environ.get("RANK", "0")) == fault_rank
    gbs = int(flags[flags.index("--global-batch-size") + 1])
    mbs = int(flags[flags.index("--micro-batch-size") + 1])
    micro_batches = gbs // (mbs * int(os.environ.get("WORLD_SIZE", "1")))  # data-parallel only
    calls = {"n": 0}

    def datasets_provider(cfg, tokenizer, num_samples):
        train, valid, test = pretrain_gpt.datasets_provider(cfg, tokenizer, num_samples)
        if kind == "corrupt" and faulty:
            train = _CorruptFrom(train, (iteration - 1) * gbs)
        return train, valid, test

    def forward_step(data_iterator, model):
        calls["n"] += 1
        if faulty and calls["n"] == (iteration - 1) * micro_batches + 1:
            if kind == "raise":
                raise InjectedFailure(f"injected failure at iteration {iteration}")
            if kind == "exit":
                os._exit(3)
            if kind == "hang":
                sys.stdout.write(f"hanging at iteration {iteration}\n")
                sys.stdout.flush()
                time.sleep(3600)
            if kind == "kill-worker":
                multiprocessing.active_children()[0].kill()
        return pretrain_gpt.forward_step(data_iterator, model)

    pretrain(datasets_provider, pretrain_gpt.model_provider, forward_step, argv=flags)


if __name__ == "__main__":
    fault.run_rank(lambda: main(sys.argv[1:]))
