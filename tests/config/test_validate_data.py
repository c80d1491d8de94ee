"""Data and tokenizer flags are checked by validate(), before any process group starts.

Each bad combination fails through ``parse_args`` with a message naming the flag and the value or
path, and through ``pretrain_gpt.py`` (a subprocess) with a non-zero exit code, the same message
and no traceback, before torch.distributed is initialized.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from megatron.config import parse_args
from megatron.config.cli import validate_or_exit
from megatron.tokenizer.gpt2 import bytes_to_unicode
from tests.conftest import REPO

BASE = ("--num-layers 2 --hidden-size 16 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --train-iters 1 --lr 1e-3").split()


@pytest.fixture()
def files(tmp_path) -> dict[str, str]:
    """An existing dataset prefix (``.bin`` + ``.idx``; validation checks they exist), one with
    only a ``.bin``, and a loadable byte-level BPE vocab (256 byte symbols + EOD, no merges)."""
    for name in ("corpus.bin", "corpus.idx", "half.bin", "a_file"):
        (tmp_path / name).write_bytes(b"")
    symbols = [*bytes_to_unicode().values(), "<|endoftext|>"]
    (tmp_path / "vocab.json").write_text(json.dumps({s: i for i, s in enumerate(symbols)}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    return {"prefix": str(tmp_path / "corpus"), "half": str(tmp_path / "half"),
            "vocab": str(tmp_path / "vocab.json"), "merges": str(tmp_path / "merges.txt"),
            "missing": str(tmp_path / "nope"), "file": str(tmp_path / "a_file")}


def _argv(template: str, files: dict[str, str]) -> list[str]:
    return BASE + template.format(**files).split()


# (extra flags, substrings the error must contain); {prefix} etc. come from ``files``.
BAD = {
    "split-four-parts": ("--data-path {prefix} --split 1,2,3,4", ["--split", "1,2,3,4"]),
    "split-all-zero": ("--data-path {prefix} --split 0,0,0", ["--split", "0,0,0"]),
    "missing-prefix": ("--data-path {missing}", ["--data-path", "{missing}", ".bin"]),
    "prefix-without-idx": ("--data-path {half}", ["--data-path", "{half}.idx"]),
    "missing-blend-component": ("--data-path 0.5 {prefix} 0.5 {missing}",
                                ["--data-path", "{missing}"]),
    "missing-train-prefix": ("--train-data-path {missing}", ["--train-data-path", "{missing}"]),
    "data-path-and-train-data-path": ("--data-path {prefix} --train-data-path {prefix}",
                                      ["--data-path", "--train-data-path"]),
    "weighted-odd-count": ("--data-path 0.3 {prefix} 0.7", ["--data-path", "3 values", "pairs"]),
    "weights-mixed": ("--data-path 0.3 {prefix} {prefix} {prefix}", ["--data-path", "weight"]),
    "gpt2-without-merge-file": ("--tokenizer-type GPT2BPETokenizer --vocab-file {vocab}",
                                ["--tokenizer-type GPT2BPETokenizer", "--merge-file"]),
    "gpt2-without-vocab-file": ("--tokenizer-type GPT2BPETokenizer --merge-file {merges}",
                                ["--tokenizer-type GPT2BPETokenizer", "--vocab-file"]),
    "bert-without-vocab-file": ("--tokenizer-type BertWordPieceLowerCase",
                                ["BertWordPieceLowerCase", "--vocab-file"]),
    "vocab-file-absent": ("--tokenizer-type GPT2BPETokenizer --vocab-file {missing} "
                          "--merge-file {merges}", ["--vocab-file", "{missing}", "no such file"]),
    "sentencepiece-without-model": ("--tokenizer-type SentencePieceTokenizer",
                                    ["--tokenizer-model"]),
    "null-without-vocab-size": ("--tokenizer-type NullTokenizer", ["--vocab-size"]),
    # These failed with a raw NotADirectoryError after the model was built.
    "save-under-a-file": ("--mock-data --save {file}/run --save-interval 1",
                          ["--save {file}/run: {file} is a regular file, not a directory"]),
    "save-is-a-file": ("--mock-data --save {file} --save-interval 1",
                       ["--save {file}: {file} is a regular file"]),
    "tensorboard-dir-under-a-file": ("--mock-data --tensorboard-dir {file}/tb/x",
                                     ["--tensorboard-dir {file}/tb/x: {file} is a regular file"]),
    "data-cache-path-under-a-file": ("--mock-data --data-cache-path {file}/cache",
                                     ["--data-cache-path {file}/cache: {file} is a regular"]),
    "zero-layers": ("--num-layers 0", ["--num-layers (0)"]),
    "negative-hidden": ("--hidden-size -8", ["--hidden-size (-8)"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_data_and_tokenizer_flags_fail_in_parse_args(case, files, capsys):
    template, expected = BAD[case]
    with pytest.raises(SystemExit) as exc:
        parse_args(_argv(template, files), world_size=1)
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    for text in expected:
        assert text.format(**files) in err, (text, err)


@pytest.mark.parametrize("template", [
    "--data-path {prefix} --split 98,2,0",
    "--data-path 0.3 {prefix} 0.7 {prefix}",
    "--data-path {prefix} {prefix}",  # unweighted blend
    "--train-data-path {prefix} --valid-data-path {prefix}",
    "--data-path {missing} --mock-data",  # --mock-data ignores the paths
    "--tokenizer-type GPT2BPETokenizer --vocab-file {vocab} --merge-file {merges}",
    "--tokenizer-type NullTokenizer --vocab-size 100",
])
def test_good_data_and_tokenizer_flags_pass(template, files):
    parse_args(_argv(template, files), world_size=1)


# One case per group of checks (data, tokenizer, model shape, pipeline) through the real
# script; every check is covered through parse_args above (the same validate() call).
CLI_CASES = ("missing-prefix", "gpt2-without-merge-file", "negative-hidden", "pipeline-parallel",
             "save-under-a-file", "no-data")


def test_pretrain_gpt_fails_fast_on_bad_flags(files):
    """Through pretrain_gpt.py: exit != 0 with the message and no traceback, before
    torch.distributed starts. The processes run concurrently (one Python start-up each)."""
    cases = {**BAD, "pipeline-parallel": ("--pipeline-model-parallel-size 2 --num-layers 3",
                                          ["--num-layers (3)",
                                           "--pipeline-model-parallel-size (2)"]),
             "no-data": ("", ["no data: give --data-path", "--mock-data"])}
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    base_env["OMP_NUM_THREADS"] = "1"
    start = time.monotonic()
    procs = {}
    for case in CLI_CASES:
        # As torchrun would launch it: validation sees the world size from the environment.
        env = {**base_env, "WORLD_SIZE": "2"} if case == "pipeline-parallel" else base_env
        procs[case] = subprocess.Popen(
            [sys.executable, str(REPO / "pretrain_gpt.py"), *_argv(cases[case][0], files)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        assert proc.returncode not in (0, None), (case, out, err)
        assert "Traceback" not in err, (case, err)
        assert "initialized tensor model parallel" not in out, (case, out)
        flat = " ".join(err.split())
        for text in cases[case][1]:
            assert text.format(**files) in flat, (case, text, err)
    # Hang detection only (a loaded 2-core machine takes tens of seconds to start 4 Pythons):
    # the no-process-group asserts above are what show validation came first.
    assert time.monotonic() - start < 240, "validation should fail within seconds"


@pytest.mark.parametrize("template,refused", [
    ("", True),
    ("--mock-data", False),
    ("--data-path {prefix}", False),
    ("--train-data-path {prefix}", False),
])
def test_the_pretraining_scripts_need_a_data_source(template, refused, files, capsys):
    """Regression: with neither --data-path (nor a per-split path) nor --mock-data,
    pretrain_gpt.py / pretrain_bert.py failed only after the model was built."""
    cfg = parse_args(_argv(template, files), validate_config=False)
    validate_or_exit(cfg, 1, require_train_length=True)  # a provider of its own: no data flag
    if not refused:
        validate_or_exit(cfg, 1, require_train_length=True, require_data=True)
        return
    with pytest.raises(SystemExit):
        validate_or_exit(cfg, 1, require_train_length=True, require_data=True)
    assert "no data: give --data-path" in capsys.readouterr().err


def test_validation_starts_no_process_group(files, monkeypatch):
    """The data checks run inside validate(), which never touches torch.distributed."""
    import torch.distributed as dist

    def boom(*args, **kwargs):
        raise AssertionError("torch.distributed used during validation")

    monkeypatch.setattr(dist, "init_process_group", boom)
    monkeypatch.setattr(dist, "new_group", boom)
    with pytest.raises(SystemExit):
        parse_args(_argv("--data-path {missing}", files), world_size=1)
