"""megatron/training/log_line.py: the TensorBoard scalars and the learning rate written through
the training loop, and the log lines.

One TP=2 run of the tiny GPT with ``--tensorboard-dir``; the event files are read back with
TensorBoard's own EventAccumulator (the real ``tensorboard`` package), as TensorBoard would.
The training and validation log lines are checked character for character (pure tests).
"""

from __future__ import annotations

import logging
import math

import pytest

from tests.training import e2e

ITERS, WARMUP, DECAY = 8, 2, 6
MAX_LR, MIN_LR = 1e-3, 1e-4


@pytest.fixture(scope="module")
def logged(gpt2_corpus, tmp_path_factory):
    tb = tmp_path_factory.mktemp("tensorboard")
    result = e2e.pooled(2, [{"argv": e2e.gpt_argv(
        gpt2_corpus, tp=2, iters=ITERS, seq=32, mbs=1, gbs=2, lr=MAX_LR, extra=[
            "--min-lr", MIN_LR, "--lr-warmup-iters", WARMUP, "--lr-decay-iters", DECAY,
            "--lr-decay-style", "cosine", "--tensorboard-dir", tb,
            "--tensorboard-log-interval", "1", "--eval-interval", "4", "--eval-iters", "1"])}])[0]
    return result, e2e.read_scalars(tb)


def test_tensorboard_event_files_hold_the_scalars(logged):
    ranks, scalars = logged
    for tag in ("lm loss", "learning-rate", "grad-norm", "loss-scale", "lm loss validation"):
        assert tag in scalars, f"no {tag!r} scalar; tags: {sorted(scalars)}"
    for tag in ("lm loss", "learning-rate", "grad-norm", "loss-scale"):
        assert sorted(scalars[tag]) == list(range(1, ITERS + 1)), (tag, sorted(scalars[tag]))
    assert {4, 8} <= set(scalars["lm loss validation"])
    # The values are the run's own: loss and grad norm of every iteration (float32 in the file).
    history = ranks[-1]["history"]
    for step, entry in enumerate(history, start=1):
        assert scalars["lm loss"][step] == pytest.approx(entry["lm loss"], rel=1e-6)
        assert scalars["grad-norm"][step] == pytest.approx(entry["grad norm"], rel=1e-6)
    assert set(scalars["loss-scale"].values()) == {1.0}  # fp32: no loss scaling
    assert all(math.isfinite(v) and 5.0 < v < 12.0 for v in scalars["lm loss validation"].values())


def expected_lr(iteration: int) -> float:
    """Cosine with linear warm-up, as logged after ``iteration`` (the LR the next step uses)."""
    if iteration <= WARMUP:
        return MAX_LR * iteration / WARMUP
    if iteration >= DECAY:
        return MIN_LR
    ratio = (iteration - WARMUP) / (DECAY - WARMUP)
    return MIN_LR + (MAX_LR - MIN_LR) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


@pytest.mark.parametrize("iteration", [1, 2, 3, 4, 5, 6, 8])
def test_logged_learning_rate_follows_the_schedule(logged, iteration):
    _, scalars = logged
    assert scalars["learning-rate"][iteration] == pytest.approx(expected_lr(iteration), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Pure: the log lines, character for character
# ---------------------------------------------------------------------------------------------

ISSUE_LINE = (" iteration       10/     100 | consumed samples:          160 | elapsed time per "
              "iteration (ms): 812.3 | learning rate: 1.500E-04 | global batch size:    16 | "
              "lm loss: 9.831236E+00 | loss scale: 1.0 | grad norm: 2.345 | number of skipped "
              "iterations:   0 | number of nan iterations:   0 |")


def test_training_line_golden():
    from megatron.training.log_line import training_log_string

    fields = dict(iteration=10, train_iters=100, consumed_samples=160, elapsed_ms=812.3,
                  learning_rate=1.5e-4, batch_size=16, losses={"lm loss": 9.831236},
                  loss_scale=1.0, grad_norm=2.345, num_zeros=None, params_norm=None, skipped=0,
                  nan=0, tokens_per_sec=20172.25)
    # Megatron's cells exactly as the issue's line; ours appended after them.
    assert training_log_string(**fields, tflops=12.34) == ISSUE_LINE + (
        " tokens per second: 20172.2 | throughput per GPU (TFLOP/s/GPU): 12.3 |")
    assert training_log_string(**fields, tflops=None) == ISSUE_LINE + \
        " tokens per second: 20172.2 |"


def test_moe_losses_in_the_line_as_megatron_core_logs_them():
    """The MoE losses are cells of the line as Megatron's ``total_loss_dict`` entries
    (``" name: value:.6E |"`` after the lm loss); the per-layer ones (``moe/<name>_layer_<i>``,
    --moe-per-layer-logging) are TensorBoard tags only, without a "vs samples" twin, as
    Megatron-Core's MoE tracker writes them."""
    import types

    from megatron.training.log_line import training_log_string, write_training_scalars

    losses = {"lm loss": 9.831236, "load_balancing_loss": 1.0123, "z_loss": 2.5,
              "moe/load_balancing_loss_layer_0": 1.0246, "moe/z_loss_layer_0": 2.5}
    fields = dict(iteration=10, train_iters=100, consumed_samples=160, elapsed_ms=812.3,
                  learning_rate=1.5e-4, batch_size=16, losses=losses, loss_scale=1.0,
                  grad_norm=2.345, num_zeros=None, params_norm=None, skipped=0, nan=0,
                  tokens_per_sec=20172.25, tflops=None)
    moe_cells = " load_balancing_loss: 1.012300E+00 | z_loss: 2.500000E+00 |"
    want = ISSUE_LINE.replace(" lm loss: 9.831236E+00 |", " lm loss: 9.831236E+00 |" + moe_cells)
    assert training_log_string(**fields) == want + " tokens per second: 20172.2 |"

    tags = []
    writer = types.SimpleNamespace(add_scalar=lambda tag, value, step: tags.append(tag))
    off = types.SimpleNamespace(log_learning_rate_to_tensorboard=False,
                                log_batch_size_to_tensorboard=False,
                                log_loss_scale_to_tensorboard=False,
                                log_world_size_to_tensorboard=False,
                                log_memory_to_tensorboard=False)
    write_training_scalars(writer, types.SimpleNamespace(logging=off), iteration=10,
                           consumed_samples=160, learning_rate=1.5e-4, batch_size=16,
                           losses=losses, loss_scale=1.0, grad_norm=None, num_zeros=None,
                           params_norm=None, tokens_per_sec=None, tflops=None, world_size=1)
    assert tags == ["lm loss", "lm loss vs samples", "load_balancing_loss",
                    "load_balancing_loss vs samples", "z_loss", "z_loss vs samples",
                    "moe/load_balancing_loss_layer_0", "moe/z_loss_layer_0"]


def test_validation_line_golden():
    from megatron.core.log import get_logger
    from megatron.training.log_line import log_validation, validation_log_string

    line = (" validation loss at iteration 10 | lm loss value: 9.800000E+00 | "
            "lm loss PPL: 1.803374E+04 | ")
    assert validation_log_string("iteration 10", {"lm loss": 9.8}) == line
    # Megatron caps the perplexity at exp(20).
    assert validation_log_string("x", {"lm loss": 25.0}).endswith(
        f"lm loss PPL: {math.exp(20):.6E} | ")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = get_logger()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        log_validation("iteration 10", {"lm loss": 9.8}, None, 10, 160, False)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert records == ["-" * (len(line) + 1), line, "-" * (len(line) + 1)]


def test_nan_iterations_counted_applied_or_skipped():
    from megatron.training.loop import _LogAccumulator

    acc = _LogAccumulator()
    acc.add({"lm loss": math.nan}, skipped=False)  # applied: a nan iteration, averaged in too
    acc.add({"lm loss": math.inf}, skipped=True)
    acc.add({"lm loss": 2.0}, skipped=True)
    acc.add({"lm loss": 3.0}, skipped=False)
    assert (acc.advanced, acc.skipped, acc.nan) == (2, 2, 2)
    assert math.isnan(acc.averages()["lm loss"])
