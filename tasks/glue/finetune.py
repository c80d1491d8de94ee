"""``--task MNLI`` / ``--task QQP``: finetune a BERT :class:`Classification` head (3 / 2
classes) on GLUE TSVs (Megatron-LM's ``tasks/glue/finetune.py``); accuracy on every
``--valid-data`` file at each epoch end.

    torchrun --nproc-per-node 2 tasks/main.py --task MNLI --train-data MNLI/train.tsv \
        --valid-data MNLI/dev_matched.tsv MNLI/dev_mismatched.tsv \
        --pretrained-checkpoint bert-345m/ --epochs 5 --lr 5e-5 --lr-warmup-fraction 0.065 ...
"""

from __future__ import annotations

import torch

from tasks.finetune_utils import (accuracy_func_provider, classification_model_provider,
                                  finetune, predictions_path)
from tasks.flags import TaskFlags
from tasks.glue.data import READERS, dataset_name_from_path, glue_dataset


class _Datasets:
    """Each --valid-data file read once, for the validation loss and the accuracy."""

    def __init__(self, task: str) -> None:
        self.task = task
        self.cache: dict[str, object] = {}

    def one(self, cfg, tokenizer, path: str):
        if path not in self.cache:
            self.cache[path] = glue_dataset(self.task, dataset_name_from_path(self.task, path),
                                            [path], tokenizer, cfg.data.seq_length)
        return self.cache[path]

    def train_valid(self, cfg, tokenizer):
        ex = cfg.section(TaskFlags)
        train = glue_dataset(self.task, "training", ex.train_data, tokenizer,
                             cfg.data.seq_length)
        valid = None
        if ex.valid_data:
            valid = torch.utils.data.ConcatDataset(
                [self.one(cfg, tokenizer, path) for path in ex.valid_data])
        return train, valid

    def metrics(self, cfg, tokenizer):
        ex = cfg.section(TaskFlags)
        if not ex.valid_data:
            return None  # training only: no accuracy of nothing ranks the epochs
        named = [(dataset_name_from_path(self.task, path), self.one(cfg, tokenizer, path))
                 for path in ex.valid_data or ()]
        return accuracy_func_provider(
            named, ex.eval_micro_batch_size or cfg.training.micro_batch_size,
            predictions_path=predictions_path(cfg))


def run_glue(argv: list[str], task: str):
    """Finetune (or with ``--epochs 0`` evaluate) on GLUE ``task``; returns the
    :class:`~tasks.finetune_utils.FinetuneResult`."""
    datasets = _Datasets(task)
    return finetune(datasets.train_valid, classification_model_provider(READERS[task][1]),
                    end_of_epoch_callback_provider=datasets.metrics, argv=argv, task=task)


def run_mnli(argv: list[str]):
    """``--task MNLI``: 3 classes; dev files ``dev_matched.tsv``, ``dev_mismatched.tsv``."""
    return run_glue(argv, "MNLI")


def run_qqp(argv: list[str]):
    """``--task QQP``: 2 classes (is_duplicate)."""
    return run_glue(argv, "QQP")
