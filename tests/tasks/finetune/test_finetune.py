"""The finetuning loop end to end through ``tasks/main.py``'s ``run`` on pooled gloo worlds:
a tiny BERT learns a synthetic task in each format (RACE, MNLI, QQP); TP=2, DP=2 and PP=2
(MNLI and RACE) equal one process; a run resumed mid-epoch repeats the straight run's losses;
--epochs 0 (also of a PP=2 checkpoint, by --load and --pretrained-checkpoint); a pretrained
BERT checkpoint loads (heads dropped) before training; flags and data refused before any
process group; one torchrun smoke run of the real script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core import parallel_state
from megatron.training import loop
from tasks import main as tasks_main
from tests.training import e2e
from tests.training.e2e import read_scalars
from tasks import finetune_sample_data as synthetic

ROOT = Path(__file__).resolve().parents[3]


# Pooled-world runner ---------------------------------------------------------------------------
def _copy_single_process_init(module: torch.nn.Module, cfg) -> None:
    """Overwrite a pipeline stage's weights with the one-process run's initial ones (stage k
    draws from ``seed + 100 k``, as Megatron's): the whole model built from ``--seed``."""
    from megatron.core.models.bert_heads import Classification

    kwargs = {"num_classes": module.num_classes} if isinstance(module, Classification) else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.model.seed)
        whole = type(module)(module.config, parallel_state.get_tensor_model_parallel_group(),
                             **kwargs)
    reference = dict(whole.named_parameters())
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(reference[e2e._global_name(module, name)])


def _single_process_init(build_model):
    """``pretrain.build_model`` whose stages start from the one-process model's weights."""
    def build(cfg, model_provider):
        def provider(cfg, pre_process=True, post_process=True):
            module = model_provider(cfg, pre_process, post_process)
            _copy_single_process_init(module, cfg)
            return module
        return build_model(cfg, provider)
    return build


def run_finetunes(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """Each run's ``tasks/main.py`` argv on this rank: the lm loss of every iteration (None
    where this rank is not the last pipeline stage), the evaluations, and (``"params"``) the
    final language-model weights; ``"single_process_init"``: the stages start from the
    one-process weights (module level: pooled)."""
    from megatron.training import pretrain

    del rank, world_size
    out = []
    for run in runs:
        parallel_state.destroy_model_parallel()
        losses: list[float | None] = []
        real_step, real_build = loop.train_step, pretrain.build_model

        def recording_step(*args, **kwargs):
            result = real_step(*args, **kwargs)
            losses.append(result[0].get("lm loss"))
            return result

        loop.train_step = recording_step
        if run.get("single_process_init"):
            pretrain.build_model = _single_process_init(real_build)
        try:
            result = tasks_main.run(run["argv"])
        finally:
            loop.train_step, pretrain.build_model = real_step, real_build
        params = None
        if run.get("params"):
            inner = result.model[0]
            while hasattr(inner, "module"):
                inner = inner.module
            params = {k: v.detach().clone() for k, v in inner.state_dict().items()}
        out.append({"losses": losses, "iteration": result.state.iteration,
                    "evaluations": [(e.epoch, e.iteration, e.metrics, e.at_epoch_end)
                                    for e in result.evaluations],
                    "best": None if result.best is None else
                    (result.best.epoch, result.best.checkpoint), "params": params})
    return out


def pooled(world_size: int, runs: list[dict]) -> list[list[dict]]:
    """``[run][rank] -> result``."""
    from tests.multiprocess import run_distributed

    per_rank = run_distributed(world_size, run_finetunes, runs, timeout=400.0)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(runs))]


# Data and flags ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("finetune")
    synthetic.write_vocab(d / "vocab.txt")
    return d


def _files(d: Path) -> dict[str, str]:
    """The synthetic task files under ``d`` (the same every call)."""
    if not (d / "vocab.txt").exists():
        synthetic.write_vocab(d / "vocab.txt")
    (d / "MNLI").mkdir(exist_ok=True)
    (d / "QQP").mkdir(exist_ok=True)
    files = {
        "mnli_train": synthetic.write_mnli(d / "MNLI" / "train.tsv", 256, seed=1),
        "mnli_small": synthetic.write_mnli(d / "MNLI" / "train_small.tsv", 64, seed=3),
        "mnli_dev": synthetic.write_mnli(d / "MNLI" / "dev_matched.tsv", 48, seed=2),
        "qqp_train": synthetic.write_qqp(d / "QQP" / "train.tsv", 128, seed=1),
        "qqp_dev": synthetic.write_qqp(d / "QQP" / "dev.tsv", 48, seed=2),
        "race_train": synthetic.write_race(d / "RACE" / "train" / "middle", 48, seed=1),
        "race_middle": synthetic.write_race(d / "RACE" / "dev" / "middle", 12, seed=2),
        "race_high": synthetic.write_race(d / "RACE" / "dev" / "high", 12, seed=3),
    }
    return {k: str(v) for k, v in files.items()}


def argv(d: Path, task: str, train: list[str], valid: list[str], *, tp: int = 1,
         mbs: int = 16, gbs: int = 16, epochs: int = 3, lr: float = 3e-3,
         dropout: float = 0.0, extra: tuple = ()) -> list[str]:
    """tasks/main.py flags of a 2-layer, hidden-64 BERT (fp32) on the synthetic vocabulary;
    the padded vocabulary (128) is the same at TP 1 and 2."""
    data_flags = (["--train-data", *train] if train else []) + ["--valid-data", *valid]
    return ["--task", task, *data_flags, "--epochs", str(epochs), "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32",
            "--tensor-model-parallel-size", str(tp), "--make-vocab-size-divisible-by",
            str(128 // tp), "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs),
            "--lr", str(lr), "--min-lr", str(lr / 10), "--lr-decay-style", "linear",
            "--lr-warmup-fraction", "0.1", "--weight-decay", "0.01", "--clip-grad", "1.0",
            "--seed", "1234", "--hidden-dropout", str(dropout), "--attention-dropout",
            str(dropout), "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
            str(d / "vocab.txt"), "--num-workers", "0", "--log-interval", "4",
            "--eval-iters", "1", "--distributed-backend", "gloo", *map(str, extra)]


def _accuracy(result: dict) -> float:
    return result["evaluations"][-1][2]["accuracy"]


# Tests ---------------------------------------------------------------------------------------
def test_learns_each_format_resumes_exactly_and_matches_tp_dp(data, tmp_path):
    """One world-of-one call (several runs) and one world-of-two call."""
    f = _files(data)
    mnli = ([f["mnli_small"]], [f["mnli_dev"]])
    straight, part = tmp_path / "straight", tmp_path / "part"
    save = ["--save-interval", "1000"]
    resume_flags = dict(mbs=8, gbs=8, epochs=2, dropout=0.1, lr=1e-3)  # 2 x 8 iterations
    reference_flags = dict(mbs=4, gbs=16, epochs=2, lr=1e-3)  # gradient accumulation: 4
    single = pooled(1, [
        {"argv": argv(data, "MNLI", [f["mnli_train"]], [f["mnli_dev"]], epochs=2, lr=5e-3)},
        {"argv": argv(data, "QQP", [f["qqp_train"]], [f["qqp_dev"]], epochs=2)},
        {"argv": argv(data, "RACE", [f["race_train"]], [f["race_middle"], f["race_high"]],
                      mbs=8, gbs=8, epochs=2, lr=1e-3)},
        {"argv": argv(data, "MNLI", *mnli, **reference_flags)},
        {"argv": argv(data, "MNLI", *mnli, **resume_flags,
                      extra=("--save", straight, *save, "--eval-interval", "5",
                             "--tensorboard-dir", tmp_path / "tb"))},
        {"argv": argv(data, "MNLI", *mnli, **resume_flags,
                      extra=("--save", part, *save, "--exit-interval", "5"))},
        {"argv": argv(data, "MNLI", *mnli, **resume_flags,
                      extra=("--save", part, *save, "--load", part, "--eval-interval", "5"))},
        {"argv": argv(data, "MNLI", [], mnli[1], epochs=0, extra=("--load", straight))},
    ])
    mnli_run, qqp_run, race_run, reference, full, first, resumed, evaluated = \
        (runs[0] for runs in single)

    # Chance is 1/3 (MNLI), 1/2 (QQP), 1/4 (RACE).
    print("accuracies", [_accuracy(r) for r in (mnli_run, qqp_run, race_run)])
    assert _accuracy(mnli_run) >= 0.8, mnli_run["evaluations"]
    assert _accuracy(qqp_run) >= 0.8, qqp_run["evaluations"]
    assert _accuracy(race_run) >= 0.7, race_run["evaluations"]
    # RACE reports each --valid-data directory and the overall accuracy.
    assert set(race_run["evaluations"][-1][2]) == {"accuracy", "accuracy dev-middle",
                                                   "accuracy dev-high"}
    assert len(mnli_run["losses"]) == 2 * (256 // 16)

    # Resume mid-epoch (iteration 5 of 8 in epoch 1): the same losses as the straight run,
    # dropout on; the --eval-interval evaluations (every 5 iterations) change nothing.
    assert first["iteration"] == 5 and len(first["losses"]) == 5
    assert first["losses"] == full["losses"][:5]
    assert resumed["losses"] == pytest.approx(full["losses"][5:], abs=1e-6, rel=0)
    assert [(e[0], e[1], e[3]) for e in full["evaluations"]] == \
        [(0, 5, False), (0, 8, True), (1, 10, False), (1, 15, False), (1, 16, True)]
    assert resumed["evaluations"] == full["evaluations"][1:]
    best_epoch, best_checkpoint = full["best"]
    assert best_checkpoint == str(straight / f"iter_{8 * (best_epoch + 1):07d}")
    scalars = read_scalars(tmp_path / "tb")  # the trainer's scalars and the accuracy
    assert sorted(scalars["accuracy validation"]) == [5, 8, 10, 15, 16]
    assert scalars["accuracy validation"][16] == \
        pytest.approx(full["evaluations"][-1][2]["accuracy"], rel=1e-6)
    assert len(scalars["lm loss"]) == 16
    # --epochs 0 on the last checkpoint: the straight run's final accuracy.
    assert evaluated["evaluations"] == [(-1, 16, full["evaluations"][-1][2], True)]
    # ... and Megatron's predictions.pt in --load: (name, (softmaxes, labels, uids)) per set.
    (name, (probs, labels, uids)), = torch.load(straight / "predictions.pt")
    assert name == "dev-matched" and uids == list(range(48)) and len(probs[0]) == 3
    hits = sum(max(range(3), key=p.__getitem__) == y for p, y in zip(probs, labels))
    assert hits / 48 == evaluated["evaluations"][0][2]["accuracy"]

    # TP=2 (also with --sequence-parallel), DP=2 and PP=2 (a world of two) finetune as one
    # process; PP=2 also for RACE (its [s, b x 4, h] activations), its checkpoint evaluated by
    # --load and as a pretrained one.
    pp2, pp_save = ("--pipeline-model-parallel-size", "2"), tmp_path / "pp2"
    tp2, tp2_sp, dp2, pp2_mnli, pp2_race, pp2_load, pp2_pretrained = pooled(2, [
        {"argv": argv(data, "MNLI", *mnli, tp=2, **reference_flags)},
        {"argv": argv(data, "MNLI", *mnli, tp=2, **reference_flags,
                      extra=("--sequence-parallel",))},
        {"argv": argv(data, "MNLI", *mnli, **{**reference_flags, "mbs": 2})},
        {"argv": argv(data, "MNLI", *mnli, **reference_flags,
                      extra=(*pp2, "--save", pp_save, *save)), "single_process_init": True},
        {"argv": argv(data, "RACE", [f["race_train"]], [f["race_middle"], f["race_high"]],
                      mbs=8, gbs=8, epochs=2, lr=1e-3, extra=pp2), "single_process_init": True},
        {"argv": argv(data, "MNLI", [], mnli[1], epochs=0, extra=(*pp2, "--load", pp_save))},
        {"argv": argv(data, "MNLI", [], mnli[1], epochs=0,
                      extra=(*pp2, "--pretrained-checkpoint", pp_save))},
    ])
    for runs in (tp2, tp2_sp, dp2):
        for rank_result in runs:
            assert rank_result["losses"] == pytest.approx(reference["losses"], abs=1e-5, rel=0)
            assert rank_result["evaluations"][-1][2] == reference["evaluations"][-1][2]
    for runs, one in ((pp2_mnli, reference), (pp2_race, race_run)):
        first, last = runs
        assert first["losses"] == [None] * len(one["losses"])  # the loss is the last stage's
        assert last["losses"] == pytest.approx(one["losses"], abs=1e-5, rel=0)
        for rank_result in runs:  # the accuracies reach every stage
            assert rank_result["evaluations"] == one["evaluations"]
    final = reference["evaluations"][-1][2]
    for rank_result in pp2_load:
        assert rank_result["evaluations"] == [(-1, 8, final, True)]
    for rank_result in pp2_pretrained:  # weights only, per stage: iteration 0
        assert rank_result["evaluations"] == [(-1, 0, final, True)]
    assert sorted(p.name for p in (pp_save / "iter_0000008").glob("mp_rank_*")) == \
        ["mp_rank_00_000", "mp_rank_00_001"]  # a shard per stage
    (name, (probs, labels, uids)), = torch.load(pp_save / "predictions.pt")  # the last rank's
    assert name == "dev-matched" and uids == list(range(48))
    hits = sum(max(range(3), key=p.__getitem__) == y for p, y in zip(probs, labels))
    assert hits / 48 == final["accuracy"]


def _write_pretrained_bert(root: Path, model_argv: list[str]) -> dict[str, torch.Tensor]:
    """A pretrained BERT checkpoint (binary head, iteration 100) as pretrain_bert.py saves
    one; returns its language-model weights."""
    from megatron.config import parse_args
    from megatron.core.models.bert import BertModel
    from megatron.core.models.builder import build_model_stage
    from megatron.training.checkpointing import TRACKER_FILENAME, get_checkpoint_name
    from megatron.training.models import bert_transformer_config
    from tasks.registry import tool_sections

    cfg = parse_args(model_argv, tool_sections=tool_sections())
    torch.manual_seed(99)
    bert = build_model_stage(BertModel, bert_transformer_config(cfg), add_binary_head=True)
    name = get_checkpoint_name(root, 100, pipeline_parallel=False, tensor_rank=0)
    name.parent.mkdir(parents=True)
    args = cfg.to_namespace()
    args.iteration, args.consumed_train_samples, args.consumed_valid_samples = 100, 3200, 0
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 100,
                "model": bert.state_dict_for_save_checkpoint()}, name)
    (root / TRACKER_FILENAME).write_text("100")
    return {f"language_model.{k}": v for k, v in bert.language_model.state_dict().items()}


def test_pretrained_checkpoint_weights_only(data, tmp_path):
    f = _files(data)
    model_argv = argv(data, "MNLI", [f["mnli_small"]], [f["mnli_dev"]], epochs=1,
                      lr=1e-30, extra=("--min-lr", "0"))
    pretrained = _write_pretrained_bert(tmp_path / "bert", model_argv)
    # lr ~ 0: the trained weights stay the loaded ones (unless the optimizer copied its
    # initial fp32 weights back: the pretrained weights would be lost at the first step).
    from_bert = ["--pretrained-checkpoint", str(tmp_path / "bert")]
    evaluate_only = argv(data, "MNLI", [], [f["mnli_dev"]], epochs=0) + from_bert
    (run,), (evaluated,) = pooled(1, [{"argv": model_argv + from_bert, "params": True},
                                      {"argv": evaluate_only, "params": True}])
    assert run["iteration"] == 4  # 64 / 16, from 0: not the checkpoint's 100
    for result in (run, evaluated):
        for name, value in pretrained.items():
            torch.testing.assert_close(result["params"][name], value, rtol=0, atol=1e-6)
        assert "classification_head.weight" in result["params"]
    assert evaluated["evaluations"][0][:2] == (-1, 0)


@pytest.mark.parametrize("change,message", [
    ({"--epochs": None}, "--task MNLI needs --epochs"),
    ({"--train-iters": "5"}, "--train-iters with --task MNLI: finetuning runs --epochs passes"),
    ({"--pipeline-model-parallel-size": "2", "--num-layers-per-virtual-pipeline-stage": "1"},
     "--num-layers-per-virtual-pipeline-stage 1: the interleaved pipeline schedule is not"),
    ({"--keep-last": True, "--micro-batch-size": "4"}, "--keep-last with gradient accumulation"),
    ({"--train-data": "{tmp}/none.tsv"}, "--train-data {tmp}/none.tsv: no such file"),
    ({"--pretrained-checkpoint": "{tmp}"}, "--pretrained-checkpoint {tmp} holds no checkpoint"),
    ({"--train-data": "{bad}"}, "{bad}:3: malformed MNLI row: 3 tab-separated columns"),
    ({"--global-batch-size": "512"}, "--train-data holds 256 samples, fewer than one global"),
])
def test_refused_before_any_process_group(data, tmp_path, monkeypatch, change, message):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("started"))
    f = _files(data)
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join((data / "MNLI" / "train.tsv").read_text().splitlines()[:2])
                   + "\n1\ttoo\tshort\n")
    args = argv(data, "MNLI", [f["mnli_train"]], [f["mnli_dev"]])
    for flag, value in change.items():
        if flag in args:
            i = args.index(flag)
            del args[i:i + 2]
        if value is True:
            args.append(flag)
        elif value is not None:
            args += [flag, value.format(tmp=tmp_path, bad=bad)]
    with pytest.raises(SystemExit) as exc:
        tasks_main.run(args)
    assert message.format(tmp=tmp_path, bad=bad) in str(exc.value), str(exc.value)


def test_without_valid_data_no_accuracy_ranks_the_epochs(data):
    # An accuracy over no samples (0 / 0 -> 0.0) would be named "best" in the summary.
    from megatron.config import parse_args
    from megatron.tokenizer.bert import BertWordPieceTokenizer
    from tasks.registry import tool_sections
    from tasks.glue.finetune import glue_datasets
    from tasks.race.finetune import race_datasets

    f = _files(data)
    tokenizer = BertWordPieceTokenizer(str(data / "vocab.txt"))
    for task, datasets, train in (("MNLI", glue_datasets("MNLI"), f["mnli_small"]),
                                  ("RACE", race_datasets(), f["race_train"])):
        cfg = parse_args(argv(data, task, [train], []), tool_sections=tool_sections())
        assert datasets.metrics(cfg, tokenizer) is None
        with_dev = parse_args(argv(data, task, [train], [f["mnli_dev"] if task == "MNLI"
                                                          else f["race_middle"]]),
                              tool_sections=tool_sections())
        assert callable(datasets.metrics(with_dev, tokenizer))


def test_cli_smoke_race_tp2(tmp_path, shared_data):
    """The real script under torchrun, two ranks at TP 2, the real BERT vocabulary."""
    synthetic.write_vocab(tmp_path / "vocab.txt")
    train = synthetic.write_race(tmp_path / "RACE" / "train" / "middle", 16, seed=1)
    dev = [synthetic.write_race(tmp_path / "RACE" / "dev" / name, 4, seed=2 + i)
           for i, name in enumerate(("middle", "high"))]
    vocab = shared_data / "tokenizers" / "bert-base-uncased-vocab.txt"
    args = argv(tmp_path, "RACE", [str(train)], [str(d) for d in dev], tp=2, mbs=8, gbs=8,
                epochs=1, extra=("--save", tmp_path / "ck", "--save-interval", "100",
                                 "--log-interval", "2"))
    args[args.index("--vocab-file") + 1] = str(vocab)
    args[args.index("--make-vocab-size-divisible-by") + 1] = "64"
    from bench.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "tasks/main.py", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "iteration        4/       4 |" in out  # 32 questions, 8 per step
    assert "|epoch: 0| metrics for dev-middle: correct / total = " in out
    assert ">> |epoch: 0| overall: correct / total = " in out and "/ 16 = " in out
    assert f"checkpoint {tmp_path / 'ck' / 'iter_0000004'}" in out
    assert (tmp_path / "ck" / "iter_0000004" / "mp_rank_01" / "model_optim_rng.pt").is_file()
