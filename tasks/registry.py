"""The tasks ``tasks/main.py --task`` runs, by name.

A task is a function ``run(argv: list[str]) -> result`` that parses the command line once
(:func:`parse_task_flags`: the common :class:`~tasks.flags.TaskFlags`, every task's own section,
and the model, tokenizer and checkpoint flags), initializes, and reports its results. Its module
is imported only when the task is chosen, so a task's dependencies cost nothing to the others.
Add a task with one :func:`register` line in the table at the bottom (Megatron-LM's
``tasks/main.py`` chain of ``if args.task == ...``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
from collections.abc import Callable, Sequence

from megatron.config import MegatronConfig
from megatron.config.cli import ToolSection, parse_command_line
from tasks.flags import TaskFlags

PROG = "tasks/main.py"


@dataclasses.dataclass(frozen=True)
class Task:
    """A registered task: its name, the ``module:function`` that runs it, and a summary."""

    name: str
    target: str
    summary: str
    flags: tuple[str, str] | None = None
    """The task's own flag section: ``("package.module:Class", "help title")``."""

    def load(self) -> Callable[[list[str]], object]:
        """Import the task's module and return its run function."""
        return _import(self.target)


def _import(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


TASKS: dict[str, Task] = {}


def register(name: str, target: str, summary: str,
             flags: tuple[str, str] | None = None) -> None:
    """Add task ``name`` (run by ``target``, ``"package.module:function"``; its own flag section
    ``flags``, ``("package.module:Class", "title")``, if it has one)."""
    if name in TASKS:
        raise ValueError(f"task {name} is registered twice")
    TASKS[name] = Task(name, target, summary, flags)
    tool_sections.cache_clear()


@functools.cache
def tool_sections() -> tuple[ToolSection, ...]:
    """The flag sections of ``tasks/main.py``: the common one, then every task's own. All tasks
    share one parser (Megatron-LM's ``get_tasks_args``), so any task's flags parse whichever
    task runs."""
    own = [(_import(task.flags[0]), task.flags[1]) for task in TASKS.values() if task.flags]
    return ((TaskFlags, "tasks"), *own)


def parse_task_flags(argv: Sequence[str]) -> tuple[MegatronConfig, argparse.ArgumentParser]:
    """``argv`` parsed once, as given (not validated), and its parser (for error lines)."""
    return parse_command_line(argv, prog=PROG, tool_sections=tool_sections())


def get_task(name: str) -> Task:
    """The task called ``name``.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"--task {name} is not a task this framework has: choose one of "
                         f"{', '.join(sorted(TASKS))}") from None


register("WIKITEXT103", "tasks.zeroshot_gpt.evaluate:run_wikitext",
         "zero-shot perplexity of a GPT on a word-level WikiText (or PTB) file")
register("LAMBADA", "tasks.zeroshot_gpt.evaluate:run_lambada",
         "zero-shot last-word accuracy of a GPT on LAMBADA (jsonl)")
register("RACE", "tasks.race.finetune:run_race",
         "finetune a BERT multiple-choice head on RACE (accuracy per --valid-data directory)")
register("MNLI", "tasks.glue.finetune:run_mnli",
         "finetune a BERT classification head on MNLI (accuracy per --valid-data file)")
register("QQP", "tasks.glue.finetune:run_qqp",
         "finetune a BERT classification head on QQP (accuracy per --valid-data file)")
register("SQUAD", "tasks.squad.finetune:run_squad",
         "finetune a BERT span head on SQuAD 1.1/2.0 (--squad-version; official EM/F1, "
         "predictions.json)", flags=("tasks.squad.flags:SquadFlags", "squad"))
