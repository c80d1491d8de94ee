"""``--task MNLI`` / ``--task QQP``: finetune a BERT :class:`Classification` head (3 / 2
classes) on GLUE TSVs (Megatron-LM's ``tasks/glue/finetune.py``); accuracy on every
``--valid-data`` file at each epoch end.

    torchrun --nproc-per-node 2 tasks/main.py --task MNLI --train-data MNLI/train.tsv \
        --valid-data MNLI/dev_matched.tsv MNLI/dev_mismatched.tsv \
        --pretrained-checkpoint bert-345m/ --epochs 5 --lr 5e-5 --lr-warmup-fraction 0.065 ...
"""

from __future__ import annotations

import functools

from tasks.eval_utils import LabelledDatasets
from tasks.finetune_utils import classification_model_provider, finetune
from tasks.glue.data import READERS, dataset_name_from_path, glue_dataset


def glue_datasets(task: str) -> LabelledDatasets:
    """GLUE ``task``'s training and validation sets (each --valid-data file read once)."""
    return LabelledDatasets(functools.partial(glue_dataset, task),
                            functools.partial(dataset_name_from_path, task))


def run_glue(argv: list[str], task: str):
    """Finetune (or with ``--epochs 0`` evaluate) on GLUE ``task``; returns the
    :class:`~tasks.finetune_utils.FinetuneResult`."""
    datasets = glue_datasets(task)
    return finetune(datasets.train_valid, classification_model_provider(READERS[task][1]),
                    end_of_epoch_callback_provider=datasets.metrics, argv=argv, task=task)


def run_mnli(argv: list[str]):
    """``--task MNLI``: 3 classes; dev files ``dev_matched.tsv``, ``dev_mismatched.tsv``."""
    return run_glue(argv, "MNLI")


def run_qqp(argv: list[str]):
    """``--task QQP``: 2 classes (is_duplicate)."""
    return run_glue(argv, "QQP")
