"""``--task RACE``: finetune a BERT :class:`MultipleChoice` head on RACE (Megatron-LM's
``tasks/race/finetune.py``); accuracy on every ``--valid-data`` directory (``dev/middle`` and
``dev/high`` reported separately, and overall) at each epoch end.

    torchrun --nproc-per-node 2 tasks/main.py --task RACE --train-data RACE/train/middle \
        RACE/train/high --valid-data RACE/dev/middle RACE/dev/high \
        --pretrained-checkpoint bert-345m/ --epochs 3 --lr 1e-5 --lr-warmup-fraction 0.06 ...
"""

from __future__ import annotations

import torch

from tasks.finetune_utils import (accuracy_func_provider, finetune,
                                  multiple_choice_model_provider, predictions_path)
from tasks.flags import TaskFlags
from tasks.race.data import RaceDataset, dataset_name_from_path


class _Datasets:
    """Each --valid-data directory read once, for the validation loss and the accuracy."""

    def __init__(self) -> None:
        self.cache: dict[str, RaceDataset] = {}

    def one(self, cfg, tokenizer, path: str) -> RaceDataset:
        if path not in self.cache:
            self.cache[path] = RaceDataset(dataset_name_from_path(path), [path], tokenizer,
                                           cfg.data.seq_length)
        return self.cache[path]

    def train_valid(self, cfg, tokenizer):
        ex = cfg.section(TaskFlags)
        train = RaceDataset("training", ex.train_data, tokenizer, cfg.data.seq_length)
        valid = None
        if ex.valid_data:
            valid = torch.utils.data.ConcatDataset(
                [self.one(cfg, tokenizer, path) for path in ex.valid_data])
        return train, valid

    def metrics(self, cfg, tokenizer):
        ex = cfg.section(TaskFlags)
        if not ex.valid_data:
            return None  # training only: no accuracy of nothing ranks the epochs
        named = [(dataset_name_from_path(path), self.one(cfg, tokenizer, path))
                 for path in ex.valid_data or ()]
        return accuracy_func_provider(
            named, ex.eval_micro_batch_size or cfg.training.micro_batch_size,
            predictions_path=predictions_path(cfg))


def run_race(argv: list[str]):
    """Finetune (or with ``--epochs 0`` evaluate) on RACE; returns the
    :class:`~tasks.finetune_utils.FinetuneResult`."""
    datasets = _Datasets()
    return finetune(datasets.train_valid, multiple_choice_model_provider(),
                    end_of_epoch_callback_provider=datasets.metrics, argv=argv, task="RACE")
