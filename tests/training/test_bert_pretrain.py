"""BERT through ``pretrain()`` with ``pretrain_bert.py``'s model provider and forward step
: TP=2, DP=2 and PP=2 equal the single process (the lm and sop losses at every
iteration and the final parameters, fp32, no dropout); an exact resume with dropout on; fp16,
bf16 with the distributed optimizer, and --bert-no-binary-head train; both losses reach
TensorBoard.

Samples: :class:`SyntheticBertSamples`, deterministic per index, with the sample contract of
Megatron-Core v0.13's BERTMaskedWordPieceDataset (``text``, ``types``, ``labels`` (-1 where not
predicted), ``is_random``, ``loss_mask``, ``padding_mask``): the model and the script are tested
here; the dataset has its own tests (tests/data/test_bert_dataset.py).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from megatron.core import parallel_state
from tests.training import e2e

CLS, SEP, MASK, PAD = 101, 102, 103, 0
VOCAB = 1023  # NullTokenizer ids 0..1022 + its EOD: 1024 rows, whatever the TP size
SEQ, ITERS = 32, 4
EQUAL_TOL = 1e-5
RESUME_TOL = 1e-6
HALF_TOL = 0.1


class SyntheticBertSamples(torch.utils.data.Dataset):
    """BERT samples of random word ids, deterministic per index: ``[CLS] A [SEP] B [SEP]`` with
    a random split and padding, 15% of the word positions predicted (80% [MASK], 10% random,
    10% kept), and a random sentence-order label."""

    def __init__(self, num_samples: int, seq_length: int, seed: int,
                 binary_head: bool = True) -> None:
        self.num_samples, self.seq_length = num_samples, seq_length
        self.seed, self.binary_head = seed, binary_head

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, Any]:
        rng = np.random.RandomState(self.seed + idx)
        length = int(rng.randint(self.seq_length // 2, self.seq_length + 1))
        # Skewed word frequencies: something a few steps can learn.
        words = 200 + np.minimum(rng.geometric(0.05, size=length - 3), 799)
        pivot = int(rng.randint(1, len(words)))
        text = np.full(self.seq_length, PAD, dtype=np.int64)
        types = np.zeros(self.seq_length, dtype=np.int64)
        text[:length] = [CLS, *words[:pivot], SEP, *words[pivot:], SEP]
        if self.binary_head:
            types[pivot + 2:length] = 1
        labels = np.full(self.seq_length, -1, dtype=np.int64)
        candidates = [i for i in range(length) if text[i] not in (CLS, SEP)]
        chosen = rng.choice(candidates, size=max(1, round(0.15 * length)), replace=False)
        for i in chosen:
            labels[i] = text[i]
            draw = rng.rand()
            text[i] = MASK if draw < 0.8 else (rng.randint(0, VOCAB) if draw < 0.9 else text[i])
        return {"text": text, "types": types, "labels": labels,
                "is_random": np.int64(rng.randint(0, 2) if self.binary_head else 0),
                "loss_mask": (labels >= 0).astype(np.int64),
                "padding_mask": (np.arange(self.seq_length) < length).astype(np.int64),
                "truncated": np.int64(0)}


def synthetic_datasets_provider(cfg, tokenizer, num_samples):
    """pretrain()'s dataset provider over :class:`SyntheticBertSamples` (train, valid)."""
    del tokenizer
    binary = cfg.model.bert_binary_head
    return (SyntheticBertSamples(num_samples[0], cfg.data.seq_length, cfg.model.seed, binary),
            SyntheticBertSamples(max(num_samples[1], 1), cfg.data.seq_length,
                                 cfg.model.seed + 10**6, binary),
            None)


def bert_argv(*, tp: int = 1, iters: int = ITERS, dropout: float = 0.0,
              extra: list[str] | tuple = ()) -> list[str]:
    """pretrain_bert.py flags of a 2-layer, hidden-64 BERT (fp32 unless ``extra`` says so)."""
    return [*e2e.TINY_MODEL, "--tensor-model-parallel-size", str(tp),
            "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
            "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", str(iters), "--lr", "5e-3", "--min-lr", "5e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--clip-grad", "1.0",
            "--weight-decay", "0.01", "--seed", "1234",
            "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout),
            "--mock-data", "--vocab-size", str(VOCAB),
            "--make-vocab-size-divisible-by", str(128 // tp), "--use-cpu-initialization",
            "--num-workers", "0", "--eval-iters", "0", "--log-interval", "2",
            "--distributed-backend", "gloo", *[str(a) for a in extra]]


# ---------------------------------------------------------------------------------------------
# Inside the ranks
# ---------------------------------------------------------------------------------------------

def _copy_single_process_init(module: torch.nn.Module, cfg) -> None:
    """Overwrite a pipeline stage's weights with the one-process run's initial ones (stage k
    draws from ``seed + 100 k``, as Megatron's): the whole BERT built from ``--seed``."""
    from megatron.core.models.bert import BertModel
    from megatron.training.models import bert_transformer_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.model.seed)
        whole = BertModel(bert_transformer_config(cfg),
                          parallel_state.get_tensor_model_parallel_group(),
                          add_binary_head=cfg.model.bert_binary_head)
    reference = dict(whole.named_parameters())
    embedding = "language_model.embedding.word_embeddings.weight"
    with torch.no_grad():
        for name, param in module.named_parameters():
            source = e2e._global_name(module, name)
            param.copy_(reference[embedding if source == "word_embeddings.weight" else source])


def _one_bert_run(run: dict) -> dict[str, Any]:
    import pretrain_bert
    from megatron.training import loop
    from megatron.training.pretrain import pretrain

    built: list[torch.nn.Module] = []

    def model_provider(cfg, pre_process=True, post_process=True):
        module = pretrain_bert.model_provider(cfg, pre_process, post_process)
        if run.get("single_process_init"):
            _copy_single_process_init(module, cfg)
        built.append(module)
        return module

    provider = run.get("datasets_provider", synthetic_datasets_provider)
    result: dict[str, Any] = {"history": [], "iteration": None, "params": None}
    train_step = loop.train_step
    loop.train_step = e2e._StepRecorder(train_step, result["history"])
    start = time.perf_counter()
    try:
        state = pretrain(provider, model_provider, pretrain_bert.forward_step,
                         argv=pretrain_bert.with_default_tokenizer(run["argv"]))
    finally:
        loop.train_step = train_step
    result["iteration"] = state.iteration
    result["seconds"] = time.perf_counter() - start
    if run.get("params"):
        result["params"] = e2e._gather_full_params(e2e._last_model(built))
    return result


def run_bert_pretrains(rank: int, world_size: int, runs: list[dict]) -> list[dict[str, Any]]:
    """Every run in order on this rank (module level: called by run_distributed)."""
    del rank, world_size
    out = []
    for run in runs:
        parallel_state.destroy_model_parallel()  # each run builds its own TP/DP groups
        out.append(_one_bert_run(run))
    return out


def pooled_bert(world_size: int, runs: list[dict]) -> list[list[dict[str, Any]]]:
    """``[run][rank] -> result`` of ``runs`` on a pooled world."""
    from tests.multiprocess import run_distributed

    per_rank = run_distributed(world_size, run_bert_pretrains, runs, timeout=300.0)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(runs))]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

def _series(result: dict, key: str) -> list[float]:
    return [h[key] for h in result["history"]]


@pytest.fixture(scope="module")
def single():
    return pooled_bert(1, [{"argv": bert_argv(), "params": True}])[0][0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    save = tmp_path_factory.mktemp("bert_resume")
    board = tmp_path_factory.mktemp("bert_board")
    runs = {
        "tp2": {"argv": bert_argv(tp=2, extra=["--tensorboard-dir", board]), "params": True},
        "dp2": {"argv": bert_argv(), "params": True},
        "pp2": {"argv": bert_argv(extra=["--pipeline-model-parallel-size", "2"]),
                "params": True, "single_process_init": True},
        "straight_dropout": {"argv": bert_argv(tp=2, dropout=0.1)},
        "first_half": {"argv": bert_argv(tp=2, dropout=0.1, extra=[
            "--save", save, "--save-interval", "1000", "--exit-interval", str(ITERS // 2)])},
        "second_half": {"argv": bert_argv(tp=2, dropout=0.1, extra=["--load", save])},
        "no_binary_head": {"argv": bert_argv(tp=2, extra=["--bert-no-binary-head"]),
                           "params": True},
        "bf16_distributed_optimizer": {"argv": bert_argv(extra=[
            "--bf16", "--use-distributed-optimizer"])},
        "fp16_tp2": {"argv": bert_argv(tp=2, extra=["--fp16", "--initial-loss-scale", "4096"])},
    }
    results = pooled_bert(2, list(runs.values()))
    out = dict(zip(runs, results))
    out["board"] = board
    return out


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_two_ranks_equal_single_process(single, two_ranks, layout):
    for rank, result in enumerate(two_ranks[layout]):
        assert result["iteration"] == ITERS
        for key in ("lm loss", "sop loss"):
            ref, got = _series(single, key), _series(result, key)
            diff = e2e.max_abs_diff(ref, got)
            assert diff <= EQUAL_TOL, f"{layout} rank {rank} {key}: {diff:.3g}\n{ref}\n{got}"
        diff = e2e.max_param_diff(single["params"], result["params"])
        assert diff <= EQUAL_TOL, f"{layout} rank {rank}: parameters differ by {diff:.3g}"
    # The run learned something (the comparison is not between two untrained models).
    losses = _series(single, "lm loss")
    assert losses[-1] < losses[0] - 0.05, losses


def test_two_pipeline_stages_equal_single_process(single, two_ranks):
    """PP=2: the embedding on stage 0; the pooler, both heads and the loss on stage 1 (its copy
    of the tied word embedding kept equal to stage 0's)."""
    first, last = two_ranks["pp2"]
    assert first["iteration"] == last["iteration"] == ITERS
    for key in ("lm loss", "sop loss"):
        diff = e2e.max_abs_diff(_series(single, key), _series(last, key))
        assert diff <= EQUAL_TOL, f"pp2 {key}: {diff:.3g}"
    stage_params = {**first["params"], **last["params"]}
    stage_params.pop("word_embeddings.weight")  # the last stage's copy...
    torch.testing.assert_close(last["params"]["word_embeddings.weight"],  # ...kept equal
                               first["params"]["language_model.embedding.word_embeddings.weight"])
    assert "lm_head.bias" in last["params"] and "binary_head.weight" in last["params"]
    diff = e2e.max_param_diff(single["params"], stage_params)
    assert diff <= EQUAL_TOL, f"pp2: parameters differ by {diff:.3g}"


def test_resume_is_exact(two_ranks):
    straight = two_ranks["straight_dropout"]
    first, second = two_ranks["first_half"], two_ranks["second_half"]
    for rank in range(2):
        assert first[rank]["iteration"] == ITERS // 2 and second[rank]["iteration"] == ITERS
        for key in ("lm loss", "sop loss"):
            full = _series(straight[rank], key)
            halves = _series(first[rank], key) + _series(second[rank], key)
            diff = e2e.max_abs_diff(full, halves)
            assert diff <= RESUME_TOL, f"rank {rank} {key}: {diff:.3g}\n{full}\n{halves}"
    # Dropout was on: the run differs from the dropout-free one.
    assert e2e.max_abs_diff(_series(straight[0], "lm loss"),
                            _series(two_ranks["tp2"][0], "lm loss")) > 1e-4


def test_without_binary_head_only_the_lm_loss(two_ranks):
    for result in two_ranks["no_binary_head"]:
        assert result["iteration"] == ITERS
        assert all(set(h) >= {"lm loss"} and "sop loss" not in h for h in result["history"])
        assert all(np.isfinite(_series(result, "lm loss")))
        names = set(result["params"])
        assert "lm_head.bias" in names
        assert not any(name.startswith(("binary_head", "language_model.pooler")) or
                       "tokentype" in name for name in names), sorted(names)


@pytest.mark.parametrize("run", ["bf16_distributed_optimizer", "fp16_tp2"])
def test_half_precision_trains_close_to_fp32(single, two_ranks, run):
    for result in two_ranks[run]:
        assert result["iteration"] == ITERS
        assert not any(h["skipped"] for h in result["history"][1:]), result["history"]
        for key in ("lm loss", "sop loss"):
            diff = e2e.max_abs_diff(_series(single, key), _series(result, key))
            assert diff <= HALF_TOL, f"{run} {key}: {diff:.3g}"


def test_both_losses_reach_tensorboard(two_ranks):
    scalars = e2e.read_scalars(two_ranks["board"])
    assert {"lm loss", "sop loss"} <= set(scalars), sorted(scalars)
    history = two_ranks["tp2"][1]["history"]
    for key in ("lm loss", "sop loss"):
        assert set(scalars[key]) == set(range(1, ITERS + 1))
        assert scalars[key][ITERS] == pytest.approx(history[-1][key], rel=1e-6)
