"""Zero-shot evaluation of a GPT checkpoint (Megatron-LM's ``tasks/zeroshot_gpt/evaluate.py``):
WIKITEXT103 perplexity and LAMBADA accuracy, with Megatron's results lines.

Every rank reads the file (a stream: :mod:`tasks.zeroshot_gpt.datasets`); micro-batch ``k`` of
each step goes to data-parallel rank ``k % dp``; the forward runs through the training
schedule (:func:`~megatron.core.pipeline_parallel.schedules.get_forward_backward_func`,
``forward_only=True``), so tensor and pipeline parallelism take the same path as in training.
The sums are reduced over data-parallel ranks and the last pipeline stage prints the results.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Iterator

import numpy as np
import torch

from megatron.config.core_configs import transformer_config
from megatron.config.validate import ToolChecks, refuse_context_parallel
from megatron.core import comm, device, parallel_state
from megatron.core.log import log_rank_0, log_rank_last
from megatron.core.models.builder import build_model_stage
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.training.inference import (check_checkpoint_to_load, check_checkpoint_vocabulary,
                                         load_model_for_inference, weights_only)
from megatron.training.initialize import build_tokenizer_from_config, initialize_from_config
from tasks.flags import TaskFlags
from tasks.registry import PROG, parse_task_flags
from tasks.zeroshot_gpt import datasets
from tasks.zeroshot_gpt.detokenizer import detokenizer_name

# What each metric sums over the whole data set (the last stage's loss function returns them).
SUMS = {"loss": ("nll", "targets", "sequences"), "accuracy": ("correct", "examples", "targets")}


def run_wikitext(argv: list[str]) -> dict:
    """``--task WIKITEXT103``: perplexity of ``--valid-data`` (a word-level text file)."""
    return _run(argv, "WIKITEXT103", "loss")


def run_lambada(argv: list[str]) -> dict:
    """``--task LAMBADA``: last-word accuracy on ``--valid-data`` (jsonl with "text")."""
    return _run(argv, "LAMBADA", "accuracy")


def _run(argv: list[str], task: str, metric: str) -> dict:
    flags, parser = parse_task_flags(argv)
    load = _or_exit(check_task_flags, flags, task)
    path = flags.section(TaskFlags).valid_data[0]
    scan = _or_exit(datasets.scan_word_level_file, path, detokenizer_name(path)) \
        if task == "WIKITEXT103" else None
    checks = ToolChecks(given=[refuse_context_parallel("zero-shot evaluation")],
                        validated=[lambda cfg: check_run(cfg, cfg.section(TaskFlags))])
    cfg = initialize_from_config(weights_only(flags, load=load), parser, tool_checks=checks)
    # Every rank has its groups before any can refuse the data below and tear them down (a rank
    # still connecting them would see its peer vanish instead of the refusal).
    comm.barrier(comm.world_group())
    ex = cfg.section(TaskFlags)
    tokenizer = build_tokenizer_from_config(cfg)
    _or_exit(check_checkpoint_vocabulary, cfg)
    seq = cfg.data.seq_length
    if task == "LAMBADA":
        data = LambadaData(path, tokenizer, ex.strict_lambada, seq)
        log_rank_0(f" > found {_or_exit(count_lambada, data)} samples.")
    else:
        data = LmData(path, tokenizer, scan, seq, ex.overlapping_eval)
    model = load_model_for_inference(cfg, functools.partial(model_provider, metric=metric))
    sums = evaluate(data, model, metric, seq_length=seq,
                    micro_batch_size=ex.eval_micro_batch_size or cfg.training.micro_batch_size,
                    dp_group=parallel_state.get_data_parallel_group(),
                    pp_group=parallel_state.get_pipeline_model_parallel_group(),
                    log_interval=cfg.logging.log_interval)
    return _or_exit(report, task, metric, sums, data)


def check_task_flags(flags, task: str) -> str | None:
    """The task flags, before any process group starts; returns the checkpoint to load:
    ``--load``, or ``--pretrained-checkpoint`` without it (Megatron-LM's zero-shot tasks read
    ``--load`` only: both work here), or None (``--random-weights``).

    Raises:
        ValueError: naming the flag, the value and the fix.
    """
    ex = flags.section(TaskFlags)
    if not ex.valid_data:
        raise ValueError(f"--task {task} needs --valid-data: the file to evaluate")
    if len(ex.valid_data) != 1:
        raise ValueError(f"--task {task} evaluates one file; --valid-data names "
                         f"{len(ex.valid_data)}: run once per file")
    datasets.check_data_file(ex.valid_data[0])
    if task == "WIKITEXT103":
        detokenizer_name(ex.valid_data[0])
    if ex.eval_micro_batch_size is not None and ex.eval_micro_batch_size < 1:
        raise ValueError(f"--eval-micro-batch-size must be >= 1, got {ex.eval_micro_batch_size}")
    ck, pretrained = flags.checkpoint, ex.pretrained_checkpoint
    if pretrained is not None and ck.load is not None \
            and os.path.abspath(ck.load) != os.path.abspath(pretrained):
        raise ValueError(f"--load {ck.load} and --pretrained-checkpoint {pretrained} name "
                         "different checkpoints: give one")
    if ck.load is None and pretrained is not None:
        check_checkpoint_to_load(pretrained, ck.ckpt_step, ck.random_weights,
                                 "--pretrained-checkpoint")
        return pretrained
    check_checkpoint_to_load(ck.load, ck.ckpt_step, ck.random_weights, "--load")
    return ck.load


def check_run(cfg, ex: TaskFlags) -> None:
    """Flags known once validated (``--use-checkpoint-args`` may bring ``--seq-length``),
    before the model is built.

    Raises:
        ValueError: naming the flag and the fix.
    """
    seq = cfg.data.seq_length
    if not 1 <= ex.overlapping_eval <= seq:
        raise ValueError(f"--overlapping-eval ({ex.overlapping_eval}) must be between 1 and "
                         f"--seq-length ({seq}): each window scores that many new targets")
    if cfg.virtual_pipeline_model_parallel_size is not None:
        # One model chunk per rank here; Megatron-LM refuses the interleaved schedule too.
        raise ValueError("--num-layers-per-virtual-pipeline-stage (the interleaved pipeline "
                         "schedule) is not supported for zero-shot evaluation, as in Megatron-LM: "
                         "evaluate a checkpoint saved without it")


def model_provider(cfg, pre_process: bool = True, post_process: bool = True, *,
                   metric: str = "loss") -> torch.nn.Module:
    """Megatron's choice: vocabulary-parallel logits for the loss, gathered ones for argmax.
    Sequence parallelism is off, as for generation: evaluation saves no activations for a
    backward, so splitting the sequence would only add communication (no weight changes)."""
    config = dataclasses.replace(transformer_config(cfg), sequence_parallel=False)
    return build_model_stage(GPTModel, config, pre_process=pre_process,
                             post_process=post_process, parallel_output=metric == "loss")


# Data ---------------------------------------------------------------------------------------
class _Progress:
    """Characters of the file read so far (for the progress lines)."""

    def __init__(self, path: str) -> None:
        self.size = max(os.path.getsize(path), 1)
        self.chars = 0

    def count(self, chunks: Iterator[str]) -> Iterator[str]:
        for chunk in chunks:
            self.chars += len(chunk)
            yield chunk

    def percent(self) -> float:
        return min(100.0, 100.0 * self.chars / self.size)


class LmData:
    """WikiText-103 (or PTB) windows, streamed; knows T_o up front and T at the end."""

    def __init__(self, path: str, tokenizer, scan: datasets.WikitextScan, seq_length: int,
                 overlapping_eval: int) -> None:
        self.path, self.scan, self.tokenizer = path, scan, tokenizer
        self.detokenizer = detokenizer_name(path)
        self.seq_length, self.stride = seq_length, overlapping_eval
        self.totals: dict = {}
        self.progress = _Progress(path)
        log_rank_0(f" > evaluating {path} with the {self.detokenizer} detokenizer; "
                   f"number of original tokens: {scan.num_original_tokens}")

    def samples(self) -> Iterator[datasets.Sample]:
        pieces = datasets.detokenized_tokens(self.path, self.detokenizer, self.scan,
                                             self.tokenizer.tokenize, observe=self.progress.count)
        return datasets.lm_windows(pieces, self.seq_length, self.stride, self.tokenizer.eod,
                                   self.totals)


class LambadaData:
    """LAMBADA examples, streamed (:func:`count_lambada` checks every line first)."""

    def __init__(self, path: str, tokenizer, strict: bool, seq_length: int) -> None:
        self.path, self.tokenizer, self.strict, self.seq_length = path, tokenizer, strict, \
            seq_length
        self.progress = None

    def samples(self) -> Iterator[datasets.Sample]:
        return datasets.lambada_samples(self.path, self.tokenizer.tokenize, self.strict,
                                        self.seq_length, self.tokenizer.eod)


def count_lambada(data: LambadaData) -> int:
    """Read (and tokenize) every example once: a bad line fails here, before any model work.

    Raises:
        ValueError: naming the file and line (:func:`datasets.lambada_samples`).
    """
    count = sum(1 for _ in data.samples())
    if count == 0:
        raise ValueError(f"--valid-data {data.path}: no examples (only blank lines)")
    return count


# Forward ------------------------------------------------------------------------------------
def forward_step(data_iterator, model, *, metric: str):
    """Megatron's contract: ``(output, loss_func)``; the loss function returns the sums."""
    batch = next(data_iterator)
    dev = device.get_device()
    tokens_ = torch.from_numpy(batch["tokens"]).to(dev)       # [b, s + 1]
    tokens, labels = tokens_[:, :-1].contiguous(), tokens_[:, 1:].contiguous()  # [b, s]
    mask = torch.from_numpy(batch["mask"]).to(dev)            # [b, s]
    position_ids = torch.arange(tokens.shape[1], device=dev).unsqueeze(0).expand_as(tokens)
    if metric == "loss":
        output = model(tokens, position_ids, None, labels=labels)     # [b, s] token losses
        return output, functools.partial(loss_sums, mask)
    output = model(tokens, position_ids, None)                        # [b, s, V] logits
    return output, functools.partial(accuracy_sums, labels, mask)


def loss_sums(mask: torch.Tensor, losses: torch.Tensor):
    """Summed NLL of the scored targets (fp64), their number, and the real sequences."""
    nll = (losses.double() * mask).sum()
    sums = {"nll": nll, "targets": mask.sum().double(),
            "sequences": (mask.sum(-1) > 0).sum().double()}
    return nll, sums


def accuracy_sums(labels: torch.Tensor, mask: torch.Tensor, logits: torch.Tensor):
    """Examples whose every target token is the argmax (Megatron's product over positions);
    padding rows (no target) are not examples."""
    scored = mask.bool()
    hit = (logits.argmax(-1) == labels) | ~scored              # [b, s]
    real = scored.any(-1)                                      # [b]
    correct = (hit.all(-1) & real).sum().double()
    return correct, {"correct": correct, "examples": real.sum().double(),
                     "targets": mask.sum().double()}


def evaluate(data, model: torch.nn.Module, metric: str, *, seq_length: int,
             micro_batch_size: int, dp_group, pp_group, log_interval: int = 100
             ) -> dict[str, float]:
    """Run every sample of ``data`` through ``model`` (this rank's stage); returns the sums of
    :data:`SUMS` over all data-parallel ranks, on every rank.

    Args:
        data: :class:`LmData` or :class:`LambadaData` (``samples()``, ``tokenizer``).
        dp_group: the data-parallel group the micro-batches are spread over (None: alone).
        pp_group: the pipeline group whose last stage computes the sums (None: alone).
    """
    seq, mbs, pad = seq_length, micro_batch_size, data.tokenizer.eod
    pp_size, dp_size = comm.world_size(pp_group), comm.world_size(dp_group)
    per_step = pp_size  # enough micro-batches per step to fill the pipeline
    filler = {"tokens": np.full((mbs, seq + 1), pad, np.int64),
              "mask": np.zeros((mbs, seq), np.int64)}
    steps = datasets.shard_steps(datasets.micro_batches(scoring(data.samples()), mbs, seq, pad),
                                 per_step, comm.rank(dp_group), dp_size, filler)
    schedule = get_forward_backward_func()
    step_fn = functools.partial(forward_step, metric=metric)
    keys = SUMS[metric]
    totals = torch.zeros(len(keys), dtype=torch.float64, device=device.get_device())
    start = time.monotonic()
    with torch.no_grad():
        for iteration, step in enumerate(steps):
            store = schedule(forward_step_func=step_fn, data_iterator=iter(step), model=[model],
                             num_microbatches=len(step), seq_length=seq, micro_batch_size=mbs,
                             forward_only=True)
            for sums in store or []:
                totals += torch.stack([sums[k] for k in keys])
            if (iteration + 1) % log_interval == 0:
                _log_progress(iteration + 1, totals, metric, start, data.progress, dp_size)
    comm.all_reduce(totals, dp_group)
    if pp_size > 1:  # only the last stage computed them
        comm.broadcast(totals, comm.global_rank(pp_group, pp_size - 1), pp_group)
    return dict(zip(keys, totals.tolist()))


def scoring(samples: Iterator[datasets.Sample]) -> Iterator[datasets.Sample]:
    """The samples with at least one scored target. Megatron's window count for
    ``--overlapping-eval`` runs about ``seq_length / overlapping_eval - 1`` windows past the end
    of the text that score nothing (31 at 1024 / 32): their forward adds 0 to every sum, so
    they are not run. Every rank drops the same samples (each reads the whole file)."""
    return (sample for sample in samples if sample.mask.any())


def _log_progress(iteration: int, totals: torch.Tensor, metric: str, start: float,
                  progress, dp: int) -> None:
    elapsed = max(time.monotonic() - start, 1e-9)
    sequences = totals[2 if metric == "loss" else 1].item()
    running = (f"running avg loss: {totals[0].item() / max(totals[1].item(), 1):.4E}"
               if metric == "loss" else
               f"running accuracy: {totals[0].item() / max(totals[1].item(), 1):.4f}")
    read = f" | {progress.percent():.1f}% of the file read" if progress is not None else ""
    # The sums are this data-parallel rank's until the final reduction: scaled by dp here.
    log_rank_last(f"> working on iteration: {iteration} | sequences: {int(sequences * dp)} | "
                  f"{sequences * dp / elapsed:.1f} sequences/s | {running} (this data-parallel "
                  f"rank){read}")


# Results ------------------------------------------------------------------------------------
def report(task: str, metric: str, sums: dict[str, float], data) -> dict:
    """Megatron-LM's results line (last rank); returns the figures on every rank."""
    line = f" validation results on {task} | "
    if metric == "loss":
        num_tokenized = data.totals["num_tokenized_tokens"]
        num_original = data.scan.num_original_tokens
        if num_tokenized < 2 or num_original < 2:
            raise ValueError(f"--valid-data {data.path}: {num_tokenized} tokens after "
                             f"tokenizing ({num_original} words): nothing to predict")
        assert round(sums["targets"]) == num_tokenized - 1, (sums, num_tokenized)
        loss = sums["nll"] / (num_tokenized - 1)
        ratio = (num_tokenized - 1) / (num_original - 1)
        result = {"num_original_tokens": num_original, "num_tokenized_tokens": num_tokenized,
                  "avg_loss": loss, "ppl": math.exp(min(20, loss)), "token_ratio": ratio,
                  "adjusted_ppl": math.exp(min(20, loss * ratio))}
        log_rank_last(f" > number of original tokens: {num_original}, number of detokenized "
                      f"tokens: {num_tokenized}")
        line += (f"avg loss: {loss:.4E} | ppl: {result['ppl']:.4E} | adjusted ppl: "
                 f"{result['adjusted_ppl']:.4E} | token ratio: {ratio} |")
    else:
        correct, total = sums["correct"], sums["examples"]
        result = {"correct": correct, "total": total, "accuracy": correct / total}
        line += (f"number correct: {correct:.4E} | total examples: {total:.4E} | avg accuracy: "
                 f"{result['accuracy']:.4E}")
    log_rank_last("-" * (len(line) + 1))
    log_rank_last(line)
    log_rank_last("-" * (len(line) + 1))
    log_rank_last("done :-)")
    return result


def _or_exit(check, *args):
    try:
        return check(*args)
    except ValueError as err:
        raise SystemExit(f"{PROG}: error: {err}") from None

