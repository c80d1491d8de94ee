"""--task SQUAD through tasks.finetune_utils.finetune on pooled gloo worlds: a tiny BERT learns
a synthetic SQuAD 2.0 task far above chance; TP=2 and PP=2 give the TP=1 losses; the saved checkpoint,
evaluated with --epochs 0, gives the same scores; predictions.json / null_odds.json written."""

from __future__ import annotations

import json

import pytest

from tests.tasks.squad.squad_files import synthetic_squad, write

SEQ = 32


def squad_argv(train: str, dev: str, vocab: str, *, tp: int = 1, epochs: int = 1,
               extra: tuple = ()) -> list[str]:
    """A 2-layer, hidden-64 BERT on the synthetic task (fp32, no dropout)."""
    return ["--task", "SQUAD", "--squad-version", "2.0", "--train-data", train,
            "--valid-data", dev, "--epochs", str(epochs),
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--tensor-model-parallel-size", str(tp), "--seq-length", str(SEQ),
            "--max-position-embeddings", str(SEQ), "--max-query-length", "8",
            "--doc-stride", "16", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--lr", "2e-3", "--lr-warmup-fraction", "0.1", "--lr-decay-style", "linear",
            "--seed", "1234", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab,
            "--make-vocab-size-divisible-by", str(128 // tp), "--use-cpu-initialization",
            "--num-workers", "0", "--eval-iters", "0", "--log-interval", "10",
            "--distributed-backend", "gloo", *extra]


def _finetune_runs(rank: int, world_size: int, runs: list[list[str]]) -> list[dict]:
    """Every run in order on this rank: its per-iteration losses (None on a pipeline stage
    without the loss) and evaluations. A run whose argv has ``--pipeline-model-parallel-size``
    starts its stages from the one-process model's weights (stage k draws from seed + 100 k)."""
    from megatron.core import parallel_state
    from megatron.training import loop, pretrain
    from tasks.squad.finetune import run_squad
    from tests.tasks.finetune.test_finetune import _single_process_init
    from tests.training.e2e import _StepRecorder

    del rank, world_size
    out = []
    for argv in runs:
        parallel_state.destroy_model_parallel()  # each run builds its own TP/DP groups
        history: list[dict] = []
        original, real_build = loop.train_step, pretrain.build_model
        loop.train_step = _StepRecorder(original, history)
        if "--pipeline-model-parallel-size" in argv:
            pretrain.build_model = _single_process_init(real_build)
        try:
            result = run_squad(argv)
        finally:
            loop.train_step, pretrain.build_model = original, real_build
        out.append({"losses": [None if h.get("lm loss") is None else float(h["lm loss"])
                               for h in history],
                    "metrics": [e.metrics for e in result.evaluations]})
    return out


def test_tiny_bert_learns_squad_2_and_tp2_pp2_equal_tp1(tmp_path, shared_data):
    from tests.multiprocess import run_distributed

    vocab = str(shared_data / "tokenizers" / "bert-base-uncased-vocab.txt")
    # 160 questions (every 4th impossible): 20 steps of 8; dev: 32 questions, 8 impossible.
    train = str(write(tmp_path / "train.json", synthetic_squad(160, seed=1, impossible_every=4)))
    dev = str(write(tmp_path / "dev.json", synthetic_squad(32, seed=2, impossible_every=4)))
    save = str(tmp_path / "ckpt")
    runs = [squad_argv(train, dev, vocab, extra=("--save", save, "--save-interval", "1000")),
            squad_argv(train, dev, vocab, tp=2),
            squad_argv(train, dev, vocab, epochs=0, extra=("--load", save)),
            squad_argv(train, dev, vocab, extra=("--pipeline-model-parallel-size", "2"))]
    per_rank = run_distributed(2, _finetune_runs, runs, timeout=600)
    dp2, tp2, evaluate_only, _ = per_rank[0]
    pp2_first, pp2_last = per_rank[0][3], per_rank[1][3]
    # The parallel layouts agree (fp32; dropout off).
    assert len(dp2["losses"]) == len(tp2["losses"]) == 20
    assert tp2["losses"] == pytest.approx(dp2["losses"], rel=1e-5, abs=1e-6)
    # Learned: chance is ~25 EM (always ""), or 1 in ~15 positions for an answer.
    scores = dp2["metrics"][-1]
    assert scores["f1"] >= 75.0 and scores["dev HasAns_exact"] >= 70.0, scores
    assert dp2["losses"][-1] < 0.5 * dp2["losses"][0]
    assert tp2["metrics"][-1]["f1"] == pytest.approx(scores["f1"], abs=1e-6)
    # PP=2 (one layer per stage): the last stage's losses are the one-process run's; the
    # first stage has none; the scores reach both stages.
    assert pp2_first["losses"] == [None] * 20
    assert pp2_last["losses"] == pytest.approx(dp2["losses"], rel=1e-5, abs=1e-6)
    for stage in (pp2_first, pp2_last):
        assert stage["metrics"][-1] == pytest.approx(scores, abs=1e-6)
    # --epochs 0 on the saved checkpoint scores the same weights the same way.
    assert evaluate_only["metrics"] == [pytest.approx(scores)]
    written = tmp_path / "ckpt" / "squad_predictions" / "dev" / "epoch_1"
    predictions = json.loads((written / "predictions.json").read_text())
    null_odds = json.loads((written / "null_odds.json").read_text())
    assert set(predictions) == set(null_odds) == {f"s2-{i}" for i in range(32)}
