"""Run a downstream task on a checkpoint (Megatron-LM's ``tasks/main.py``).

    torchrun --nproc-per-node 2 tasks/main.py --task WIKITEXT103 \
        --valid-data wikitext-103/wiki.test.tokens --overlapping-eval 32 \
        --load ckpt/ --use-checkpoint-args --tokenizer-type GPT2BPETokenizer \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --micro-batch-size 8

    tasks/main.py --task LAMBADA --valid-data lambada_test.jsonl --strict-lambada ...

The tasks are those of :mod:`tasks.registry`; the flags are Megatron-LM's ``tasks`` section
(:class:`tasks.flags.TaskFlags`) plus the model, tokenizer and checkpoint flags of
``pretrain_gpt.py``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.training import fault  # noqa: E402
from tasks.flags import TaskFlags  # noqa: E402
from tasks.registry import PROG, get_task, parse_task_flags  # noqa: E402


def run(argv: list[str] | None = None):
    """Parse ``--task`` and run that task on ``argv``; returns the task's result.

    Raises:
        SystemExit: no or an unknown ``--task`` (and any bad flag), with a one-line message.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    flags, _ = parse_task_flags(argv)  # the task parses argv again: it owns its configuration
    name = flags.section(TaskFlags).task
    if name is None:
        raise SystemExit(f"{PROG}: error: --task is required")
    try:
        task = get_task(name)
    except ValueError as err:
        raise SystemExit(f"{PROG}: error: {err}") from None
    return task.load()(argv)


def main(argv: list[str] | None = None):
    result = run(argv)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    # Any error ends this rank at once and stops the other ranks (see megatron.training.fault).
    fault.run_rank(main)
