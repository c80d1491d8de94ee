"""The SQuAD recipe's flags (Google's ``run_squad.py`` names, Megatron's spelling), typed.

Read with ``cfg.section(SquadFlags)``; ``--task SQUAD`` checks them with :func:`check_squad_flags`
before any process group starts. ``--seq-length`` is the recipe's ``max_seq_length`` (384).
"""

from __future__ import annotations

import dataclasses

from megatron.config.base import spec
from tasks.squad.reader import VERSIONS


@dataclasses.dataclass(kw_only=True)
class SquadFlags:
    """SQuAD finetuning (--task SQUAD)."""

    squad_version: str = spec("1.1", choices=VERSIONS)
    """SQuAD 1.1 (every question answerable) or 2.0 (impossible questions: the null answer)."""
    doc_stride: int = 128
    """Sub-tokens between the starts of two windows of a long document."""
    max_query_length: int = 64
    """Sub-tokens of the question kept (the rest is cut)."""
    max_answer_length: int = 30
    """Longest predicted answer, in sub-tokens."""
    n_best_size: int = 20
    """Start and end candidates per window, and the length of the n-best list."""
    null_score_diff_threshold: float = 0.0
    """SQuAD 2.0: predict no answer when the null score minus the best answer's score exceeds
    this (tune it on dev: the evaluation reports best_f1_thresh)."""
    predictions_dir: str | None = None
    """Where each evaluation writes predictions.json (and null_odds.json for 2.0) per
    --valid-data file and epoch (default: --save/squad_predictions; neither: not written)."""
    write_nbest: bool = False
    """Also write nbest_predictions.json (the n-best answers with probabilities)."""


def check_squad_flags(flags: SquadFlags, seq_length: int | None) -> None:
    """The recipe's values, alone and against ``--seq-length``.

    Raises:
        ValueError: naming the flag, the value and the fix.
    """
    for name in ("doc_stride", "max_query_length", "max_answer_length", "n_best_size"):
        value = getattr(flags, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if seq_length is not None and seq_length - flags.max_query_length - 3 < 1:
        raise ValueError(f"--seq-length {seq_length} leaves no document tokens after "
                         f"--max-query-length {flags.max_query_length} and [CLS]/[SEP]/[SEP]: "
                         "raise --seq-length or lower --max-query-length")
