"""``--task RACE``: finetune a BERT :class:`MultipleChoice` head on RACE (Megatron-LM's
``tasks/race/finetune.py``); accuracy on every ``--valid-data`` directory (``dev/middle`` and
``dev/high`` reported separately, and overall) at each epoch end.

    torchrun --nproc-per-node 2 tasks/main.py --task RACE --train-data RACE/train/middle \
        RACE/train/high --valid-data RACE/dev/middle RACE/dev/high \
        --pretrained-checkpoint bert-345m/ --epochs 3 --lr 1e-5 --lr-warmup-fraction 0.06 ...
"""

from __future__ import annotations

from tasks.eval_utils import LabelledDatasets
from tasks.finetune_utils import finetune, multiple_choice_model_provider
from tasks.race.data import RaceDataset, dataset_name_from_path


def race_datasets() -> LabelledDatasets:
    """RACE's training and validation sets (each --valid-data directory read once)."""
    return LabelledDatasets(RaceDataset, dataset_name_from_path)


def run_race(argv: list[str]):
    """Finetune (or with ``--epochs 0`` evaluate) on RACE; returns the
    :class:`~tasks.finetune_utils.FinetuneResult`."""
    datasets = race_datasets()
    return finetune(datasets.train_valid, multiple_choice_model_provider(),
                    end_of_epoch_callback_provider=datasets.metrics, argv=argv, task="RACE")
