"""megatron/training/lr_schedule.py: learning-rate and weight-decay schedule values, the
scheduler's checkpoint state and its checks (pure)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from megatron.training.lr_schedule import OptimizerParamScheduler


def scheduler(style="linear", warmup=100, decay=1000, max_lr=1.0, min_lr=0.1, **kw):
    opt = SimpleNamespace(param_groups=[{"lr_mult": 1.0, "wd_mult": 1.0}, {"wd_mult": 0.0}])
    return OptimizerParamScheduler(
        opt, max_lr=max_lr, min_lr=min_lr, lr_warmup_steps=warmup, lr_decay_steps=decay,
        lr_decay_style=style, start_wd=kw.get("start_wd", 0.01), end_wd=kw.get("end_wd", 0.01),
        wd_incr_steps=decay, wd_incr_style=kw.get("wd_style", "constant"))


def lr_at(sched, step):
    sched.num_steps = 0
    sched.step(step)
    return sched.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("style,step,expected", [
    ("linear", 0, 0.0), ("linear", 50, 0.5), ("linear", 100, 1.0),
    ("linear", 550, 0.1 + 0.5 * 0.9), ("linear", 1000, 0.1), ("linear", 5000, 0.1),
    ("cosine", 100, 1.0), ("cosine", 550, 0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.5) + 1)),
    ("cosine", 1000, 0.1), ("constant", 50, 0.5), ("constant", 900, 1.0),
    ("inverse-square-root", 400, math.sqrt(100) / math.sqrt(400)),
    ("inverse-square-root", 900, max(0.1, 10 / 30)),
])
def test_lr_values(style, step, expected):
    assert lr_at(scheduler(style), step) == pytest.approx(expected)


def test_weight_decay_increment_and_multipliers():
    sched = scheduler(wd_style="linear", start_wd=0.0, end_wd=0.1)
    sched.num_steps = 0
    sched.step(500)
    assert sched.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.05)
    assert sched.optimizer.param_groups[1]["weight_decay"] == 0.0  # wd_mult 0: no decay
    cos = scheduler(wd_style="cosine", start_wd=0.0, end_wd=0.1)
    cos.num_steps = 0
    cos.step(250)
    assert cos.get_wd() == pytest.approx(0.1 * 0.5 * (math.cos(math.pi * 0.75) + 1))


def test_state_dict_round_trip_and_mismatch():
    a = scheduler()
    a.step(300)
    b = scheduler()
    b.load_state_dict(a.state_dict())
    assert b.num_steps == 300 and b.get_lr() == a.get_lr()
    strict = scheduler(max_lr=2.0)  # Megatron's default: a differing value is an error
    assert strict.use_checkpoint_opt_param_scheduler is False
    with pytest.raises(ValueError, match="override-opt_param-scheduler"):
        strict.load_state_dict(a.state_dict())
    from_checkpoint = scheduler(max_lr=2.0)
    from_checkpoint.use_checkpoint_opt_param_scheduler = True
    from_checkpoint.load_state_dict(a.state_dict())
    assert from_checkpoint.max_lr == 1.0 and from_checkpoint.num_steps == 300
    override = scheduler(max_lr=2.0)
    override.override_opt_param_scheduler = True
    override.load_state_dict(a.state_dict())
    assert override.max_lr == 2.0 and override.num_steps == 300


def test_bad_lengths_rejected():
    with pytest.raises(ValueError, match="warm-up"):
        scheduler(warmup=1000, decay=1000)
