"""tasks/main.py --task SQUAD: refusals before any process group (bad flags, malformed files),
and one smoke run of the real script writing the official files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks import main as tasks_main
from tests.tasks.squad.squad_files import squad_dict, write

ROOT = Path(__file__).resolve().parents[3]


def _argv(shared_data, train, dev, *extra) -> list[str]:
    return ["--task", "SQUAD", "--train-data", str(train), "--valid-data", str(dev),
            "--epochs", "1", "--num-layers", "1", "--hidden-size", "16",
            "--num-attention-heads", "2", "--seq-length", "64", "--max-position-embeddings", "64",
            "--max-query-length", "16", "--doc-stride", "32", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--lr", "1e-3", "--tokenizer-type",
            "BertWordPieceLowerCase", "--vocab-file",
            str(shared_data / "tokenizers" / "bert-base-uncased-vocab.txt"),
            "--distributed-backend", "gloo", "--num-workers", "0", "--eval-iters", "0",
            *extra]


def _bad_start(content):
    content["data"][0]["paragraphs"][0]["qas"][1]["answers"][0]["answer_start"] = 3
    return content


def _no_question(content):
    del content["data"][1]["paragraphs"][0]["qas"][0]["question"]
    return content


@pytest.mark.parametrize("edit,which,extra,message", [
    (None, None, ("--doc-stride", "0"), "--doc-stride must be >= 1, got 0"),
    (None, None, ("--max-query-length", "62"),
     "--seq-length 64 leaves no document tokens after --max-query-length 62"),
    (None, None, ("--squad-version", "3.0"), "argument --squad-version: invalid choice"),
    (_bad_start, "train", (), "{train}: data[0].paragraphs[0].qas[1].answers[0] (question id "
                              "'company'): answer \"Edison's company\" does not match the context "
                              "at answer_start 3"),
    (_no_question, "dev", (), "{dev}: missing key 'data[1].paragraphs[0].qas[0].question' "
                              "(question id 'actor')"),
    (None, "v2", (), "{train}: question id 'king' is_impossible: that is a SQuAD 2.0 file; "
                     "pass --squad-version 2.0"),
])
def test_refused_before_any_process_group(tmp_path, shared_data, monkeypatch, capsys,
                                          edit, which, extra, message):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("started"))
    train = write(tmp_path / "train.json", squad_dict(impossible=which == "v2"))
    dev = write(tmp_path / "dev.json", squad_dict(impossible=False))
    if edit is not None:
        path = train if which == "train" else dev
        write(path, edit(json.loads(path.read_text())))
    with pytest.raises(SystemExit) as exc:
        tasks_main.run(_argv(shared_data, train, dev, *extra))
    text = str(exc.value) + capsys.readouterr().err
    assert message.format(train=train, dev=dev) in text, text
    # Not a BERT WordPiece tokenizer: refused by name.
    if extra == ("--doc-stride", "0"):
        argv = _argv(shared_data, train, dev)
        argv[argv.index("BertWordPieceLowerCase")] = "GPT2BPETokenizer"
        with pytest.raises(SystemExit, match="use --tokenizer-type BertWordPieceLowerCase or "
                                             "BertWordPieceCase, not GPT2BPETokenizer"):
            tasks_main.run(argv)


def test_cli_smoke_squad_1_1(tmp_path, shared_data):
    train = write(tmp_path / "train-v1.1.json", squad_dict(impossible=False))
    dev = write(tmp_path / "dev-v1.1.json", squad_dict(impossible=False))
    out_dir = tmp_path / "results"
    cmd = [sys.executable, "tasks/main.py",
           *_argv(shared_data, train, dev, "--squad-version", "1.1", "--predictions-dir",
                  str(out_dir), "--write-nbest", "--log-interval", "1")]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "finetuning for 1 epochs of 3 iterations" in out  # 7 questions, batches of 2
    assert " > |epoch: 0| metrics for dev-v1.1: exact_match = " in out
    assert " >> best f1: " in out
    written = out_dir / "dev-v1.1" / "epoch_1"
    predictions = json.loads((written / "predictions.json").read_text())
    assert set(predictions) == {"born", "company", "nation", "city", "quoted", "actor", "decade"}
    assert all(isinstance(v, str) and v for v in predictions.values())
    nbest = json.loads((written / "nbest_predictions.json").read_text())
    assert sum(e["probability"] for e in nbest["born"]) == pytest.approx(1.0)
    assert not (written / "null_odds.json").exists()
