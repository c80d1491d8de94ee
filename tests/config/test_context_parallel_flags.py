"""``--context-parallel-size`` and ``--cp-comm-type``: the data-parallel size they leave, the
model config they reach, and every combination refused before any process group starts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.config import parse_args
from megatron.config.core_configs import transformer_config
from megatron.config.validate import check_bert_flags, refuse_context_parallel
from megatron.core.parallel_state import grid_groups, rank_layout

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 8 --seq-length 32 "
        "--max-position-embeddings 64 --micro-batch-size 2 --attention-dropout 0").split()


def parse(extra: str, world_size: int):
    return parse_args(BASE + extra.split(), world_size=world_size)


def test_cp_ranks_are_not_data_parallel_ranks():
    cfg = parse("--context-parallel-size 2 --tensor-model-parallel-size 2", 8)
    assert cfg.data_parallel_size == 2 and cfg.training.global_batch_size == 4
    config = transformer_config(cfg)
    assert config.context_parallel_size == 2 and config.cp_comm_type == ["p2p"]


def test_per_layer_comm_types_and_the_allgather_spelling():
    cfg = parse("--context-parallel-size 2 --cp-comm-type a2a allgather", 2)
    config = transformer_config(cfg)
    assert config.cp_comm_type == ["a2a", "all_gather"]
    assert [config.cp_comm_type_of(n) for n in (1, 2)] == ["a2a", "all_gather"]


@pytest.mark.parametrize("extra, world, match", [
    ("--context-parallel-size 2", 3, r"not divisible by .*--context-parallel-size \(2\) = 2"),
    ("--context-parallel-size 4 --seq-length 36", 4,
     r"--seq-length \(36\) must be a multiple of 2 x --context-parallel-size \(8\)"),
    ("--context-parallel-size 2 --cp-comm-type a2a+p2p", 2, "hierarchical"),
    ("--context-parallel-size 2 --cp-comm-type ring", 2, "--cp-comm-type ring"),
    ("--context-parallel-size 2 --cp-comm-type p2p p2p p2p", 2, "gives 3 values for --num-layers"),
    ("--context-parallel-size 2 --reset-attention-mask", 2, "--reset-attention-mask"),
    ("--context-parallel-size 2 --attention-dropout 0.1", 2, "--attention-dropout"),
    ("--context-parallel-size 4 --cp-comm-type a2a --group-query-attention "
     "--num-query-groups 2", 4, "a2a splits each TP rank's 8 query heads and 2 key/value"),
])
def test_refused_before_any_process_group(capsys, extra, world, match):
    with pytest.raises(SystemExit):
        parse(extra, world)
    err = capsys.readouterr().err
    assert re.search(match, err), err


def test_tools_and_bert_refuse_cp():
    cfg = parse("--context-parallel-size 2", 2)
    with pytest.raises(ValueError, match="text generation runs at context-parallel size 1"):
        refuse_context_parallel("text generation")(cfg)
    with pytest.raises(ValueError, match="BERT"):
        check_bert_flags(cfg)
    refuse_context_parallel("text generation")(parse("", 1))  # CP=1: accepted


@pytest.mark.parametrize("script, what", [
    (["tools/generate.py"], "text generation"),
    (["tasks/main.py", "--task", "LAMBADA", "--valid-data", "{data}"], "zero-shot evaluation"),
])
def test_generation_and_zero_shot_refuse_cp_by_name(tmp_path, script, what):
    """The scripts themselves, one process without torchrun: the refusal comes from
    validation, before any process group (none could start in a world of one)."""
    data = tmp_path / "lambada.jsonl"
    data.write_text('{"text": "a b c"}\n')
    argv = [a.format(data=data) for a in script] + [
        "--context-parallel-size", "2", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
        "--random-weights", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, *argv], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0
    assert (f"--context-parallel-size 2: {what} runs at context-parallel size 1"
            in done.stderr), done.stderr[-2000:]


def test_layout_follows_megatron_core_order():
    """tp-cp-dp-pp: TP fastest, then CP, then DP, PP slowest (16 ranks, TP=2, CP=2, PP=2)."""
    layout = rank_layout(16, 2, 2, context_parallel_size=2)
    assert layout.data_parallel_size == 2
    assert layout.tensor[:2] == [[0, 1], [2, 3]]
    assert layout.context[:3] == [[0, 2], [1, 3], [4, 6]]
    assert layout.data[:3] == [[0, 4], [1, 5], [2, 6]]
    assert layout.data_with_context[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.model[:2] == [[0, 1, 8, 9], [2, 3, 10, 11]]
    assert layout.pipeline[0] == [0, 8]
    # Every kind partitions the world.
    for kind in ("tensor", "context", "data", "data_with_context", "model", "pipeline"):
        assert sorted(r for g in getattr(layout, kind) for r in g) == list(range(16)), kind


def test_grid_groups_equal_the_cp1_layout():
    layout = rank_layout(16, 2, 2)
    sizes = {"tp": 2, "dp": 4, "pp": 2}
    assert grid_groups(16, sizes, "dp") == sorted(layout.data)
    assert grid_groups(16, sizes, "tp-pp") == sorted(layout.model)
    assert layout.context == [] and layout.context_parallel_size == 1


def test_the_layout_cli_prints_the_context_groups(capsys):
    from megatron.core.parallel_state import main

    assert main(["--world-size", "8", "--context-parallel-size", "2",
                 "--tensor-model-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "context-parallel groups:        [0,2] [1,3] [4,6] [5,7]" in out
    assert "data x context groups:          [0,2,4,6] [1,3,5,7]" in out
