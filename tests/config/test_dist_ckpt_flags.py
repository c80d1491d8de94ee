"""The torch_dist checkpoint flags: Megatron's names and defaults, their combinations refused
by name."""

from __future__ import annotations

import pytest

from megatron.config import parse_args

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32 "
        "--max-position-embeddings 64 --micro-batch-size 2 --train-iters 10 --lr 1e-3").split()


def parse(extra: str, world_size: int = 2):
    return parse_args(BASE + extra.split(), world_size=world_size)


def test_defaults_are_megatrons_except_the_format():
    ck = parse("").checkpoint
    assert ck.ckpt_format == "torch"  # Megatron-LM: torch_dist (docs/compatibility.md)
    assert ck.dist_ckpt_strictness == "assume_ok_unexpected"
    assert ck.ckpt_fully_parallel_save and not ck.async_save and not ck.auto_detect_ckpt_format


def test_torch_dist_with_the_distributed_optimizer_and_async_save():
    ck = parse("--ckpt-format torch_dist --save s --save-interval 5 --use-distributed-optimizer "
               "--async-save --no-ckpt-fully-parallel-save --dist-ckpt-strictness log_all "
               "--auto-detect-ckpt-format").checkpoint
    assert ck.async_save and not ck.ckpt_fully_parallel_save
    assert ck.dist_ckpt_strictness == "log_all"


@pytest.mark.parametrize("extra,message", [
    ("--async-save", "--async-save needs --ckpt-format torch_dist"),
    ("--ckpt-format torch_dist --ckpt-fully-parallel-load", "--ckpt-fully-parallel-load"),
    ("--ckpt-format torch_dist --ckpt-assume-constant-structure",
     "--ckpt-assume-constant-structure"),
])
def test_refused_by_name(extra, message, capsys):
    with pytest.raises(SystemExit):
        parse(extra)
    assert message in capsys.readouterr().err


def test_torch_dist_saves_with_any_optimizer():
    parse("--ckpt-format torch_dist --save s --save-interval 5 --no-save-optim")
    parse("--ckpt-format torch_dist --save s --save-interval 5")
    parse("--ckpt-format torch_dist --save s --save-interval 5 --optimizer sgd --bf16")
