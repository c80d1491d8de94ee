"""The synthetic task files of the tests: :mod:`tasks.finetune_sample_data` (also the data of
the examples' demo runs)."""

from tasks.finetune_sample_data import (  # noqa: F401 - re-exported
    MNLI_CUES, OBJECTS, SUBJECTS, VERBS, write_mnli, write_qqp, write_race, write_vocab)
