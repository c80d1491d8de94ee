"""Every numeric flag with a range is checked by validate(), before any process group starts.

A value outside the range (or a float "nan"/"inf", which argparse's ``float`` accepts) exits
through ``parse_args`` with code 2 and a message naming the flag, the value and the range;
the bounds themselves are accepted.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from megatron.config import parse_args
from megatron.config.base import _strip_none, flag_name
from megatron.config.cli import SECTIONS
from megatron.config.validate import _DEPRECATED, NOT_IMPLEMENTED, RANGES, _check_ranges
from tests.config.test_cli import BASE


def _field(section: str, name: str) -> dataclasses.Field:
    cls = next(c for attr, c, _ in SECTIONS if attr == section)
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _is_float(section: str, name: str) -> bool:
    cls = next(c for attr, c, _ in SECTIONS if attr == section)
    return _strip_none(typing.get_type_hints(cls)[name]) is float


def _outside(section: str, name: str) -> list[str]:
    """Values just outside the range of the flag (and nan / inf for floats)."""
    allowed = RANGES[(section, name)]
    is_float = _is_float(section, name)
    step = 0.5 if is_float else 1
    values = []
    if allowed.low is not None:
        values.append(allowed.low if allowed.low_open else allowed.low - step)
    if allowed.high is not None:
        values.append(allowed.high if allowed.high_open else allowed.high + step)
    out = [str(float(v) if is_float else int(v)) for v in values]
    return out + (["nan", "inf", "-inf"] if is_float else [])


def _inside(section: str, name: str) -> list[str]:
    """The closed bounds of the range."""
    allowed = RANGES[(section, name)]
    is_float = _is_float(section, name)
    values = [v for v, is_open in ((allowed.low, allowed.low_open),
                                   (allowed.high, allowed.high_open))
              if v is not None and not is_open]
    return [str(float(v) if is_float else int(v)) for v in values]


CASES = [(section, name, value) for section, name in RANGES for value in _outside(section, name)]


def test_every_numeric_flag_has_a_range():
    """A new int/float flag must be given a range in validate.RANGES (deprecated and not-built
    flags are refused whatever their value)."""
    missing = []
    for attr, cls, _ in SECTIONS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init or _strip_none(hints[f.name]) not in (int, float):
                continue
            if (attr, f.name) not in RANGES and (attr, f.name) not in _DEPRECATED \
                    and (attr, f.name) not in NOT_IMPLEMENTED:
                missing.append(flag_name(f))
    assert not missing, f"numeric flags without a range in validate.RANGES: {missing}"


@pytest.mark.parametrize("section,name,value", CASES,
                         ids=[f"{flag_name(_field(s, n))}={v}" for s, n, v in CASES])
def test_out_of_range_value_names_flag_value_and_range(section, name, value, capsys):
    flag = flag_name(_field(section, name))
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + [f"{flag}={value}"], world_size=1)
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    shown = repr(float(value)) if _is_float(section, name) else value
    assert f"{flag} ({shown}) must be {RANGES[(section, name)].text}" in err, err


@pytest.mark.parametrize("section,name", [key for key in RANGES if _inside(*key)],
                         ids=[flag_name(_field(*key)) for key in RANGES if _inside(*key)])
def test_closed_bounds_are_accepted(section, name):
    """The range check alone (other checks may refuse a bound for another reason, e.g. a flag
    whose feature is not built, or --seq-length 1 with the base --max-position-embeddings)."""
    flag = flag_name(_field(section, name))
    for value in _inside(section, name):
        _check_ranges(parse_args(BASE + [flag, value], validate_config=False))


@pytest.mark.parametrize("extra,expected", [
    # The issue's five: each used to fail after the model was built, or not at all.
    ("--lr nan", "--lr (nan) must be a finite number >= 0"),
    ("--weight-decay -0.1", "--weight-decay (-0.1) must be a finite number >= 0"),
    ("--adam-beta1 1.5", "--adam-beta1 (1.5) must be in [0, 1)"),
    ("--init-method-std -0.02", "--init-method-std (-0.02) must be a finite number > 0"),
    ("--train-iters -5", "--train-iters (-5) must be a positive integer"),
    ("--tensor-model-parallel-size 0", "--tensor-model-parallel-size (0) must be a positive"),
    ("--rampup-batch-size 4 x 10", "--rampup-batch-size takes 3 integers"),
    ("--rampup-batch-size 4 4", "--rampup-batch-size takes 3 integers"),
    ("--rampup-batch-size 0 2 10 --train-samples 100", "the batch sizes must be positive"),
    ("--rampup-batch-size 3 2 10 --train-samples 100",
     "--rampup-batch-size start (3) must be a multiple of --micro-batch-size"),
    ("--train-iters 10 --lr-warmup-iters 10",
     "--lr-warmup-iters (10) must be shorter than the learning-rate decay, --train-iters (10)"),
    ("--train-iters 10 --lr-decay-iters 4 --lr-warmup-iters 5",
     "--lr-warmup-iters (5) must be shorter than the learning-rate decay, --lr-decay-iters (4)"),
    ("--train-samples 100 --lr-warmup-samples 200",
     "--lr-warmup-samples (200) must be shorter than the learning-rate decay, "
     "--train-samples (100)"),
    ("--fp16 --initial-loss-scale 4 --min-loss-scale 8",
     "--min-loss-scale (8.0) must be at most --initial-loss-scale (4.0)"),
])
def test_issue_cases_and_cross_checks(extra, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + extra.split(), world_size=1)
    assert exc.value.code == 2
    assert expected in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("extra", [
    "--train-iters 10 --lr-warmup-iters 9",
    "--train-iters 10 --lr-warmup-fraction 0.99",
    "--train-samples 100 --lr-decay-samples 80 --lr-warmup-samples 79",
    "--clip-grad 0 --weight-decay 0 --adam-beta2 0 --hidden-dropout 0 --eval-iters 0",
    "--rampup-batch-size 2 2 10 --global-batch-size 8 --train-samples 100",
])
def test_good_values_pass(extra):
    parse_args(BASE + extra.split(), world_size=1)
