"""Megatron-LM's ``tasks`` flag section (``tasks/main.py``'s ``get_tasks_args``), typed.

Every task reads it with ``cfg.section(TaskFlags)``. A flag several tasks read goes here
(Megatron-LM has one section for all tasks); a task with a recipe of its own registers its own
section with the task (:mod:`tasks.registry`, e.g. SQuAD's :class:`tasks.squad.flags.SquadFlags`).
"""

from __future__ import annotations

import dataclasses

from megatron.config.base import spec


@dataclasses.dataclass(kw_only=True)
class TaskFlags:
    """Which task, its data, and its evaluation options."""

    task: str | None = None
    """Task name (required): WIKITEXT103, LAMBADA (zero-shot GPT); RACE, MNLI, QQP, SQUAD (BERT
    finetuning)."""
    train_data: list[str] | None = spec(None, nargs="+")
    """Path(s) to the training data (finetuning tasks: RACE directories, GLUE TSV files)."""
    epochs: int | None = None
    """Number of finetuning epochs; 0 evaluates the --load (or --pretrained-checkpoint) weights
    on --valid-data without training."""
    keep_last: bool = False
    """Keep the last partial batch of each finetuning epoch (dropped by default)."""
    valid_data: list[str] | None = spec(None, nargs="*")
    """Path(s) to the validation data (the zero-shot tasks take exactly one file; finetuning
    reports the accuracy of each)."""
    pretrained_checkpoint: str | None = None
    """Pretrained checkpoint to start from: finetuning loads its weights only (when starting at
    iteration 0); the zero-shot tasks evaluate it when --load is not given."""
    overlapping_eval: int = 32
    """Sliding window for overlapping evaluation (WIKITEXT103): each window after the first
    scores only its last this-many targets (1 <= value <= --seq-length)."""
    strict_lambada: bool = False
    """Use the more difficult formulation of LAMBADA: the whole last word (all its tokens) must
    be predicted, not only its last token."""
    eval_micro_batch_size: int | None = None
    """Evaluation batch size per model instance (default: --micro-batch-size)."""

