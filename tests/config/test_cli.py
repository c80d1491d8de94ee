"""Flags: Megatron names and defaults, grouped help, and every impossible combination."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.config import build_parser, parse_args
from megatron.config.cli import SECTIONS, validate_or_exit

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32 "
        "--max-position-embeddings 64 --micro-batch-size 2").split()
GOLDEN = Path(__file__).with_name("accepted_flags.txt")


def parse(extra: str = "", world_size: int = 1):
    return parse_args(BASE + extra.split(), world_size=world_size)


def accepted_flags() -> list[str]:
    return sorted(opt for action in build_parser()._actions for opt in action.option_strings)


def test_golden_flag_list():
    """Adding or removing a flag is a deliberate act: update accepted_flags.txt with it."""
    assert accepted_flags() == GOLDEN.read_text().split()


def test_megatron_defaults():
    cfg = parse()
    assert cfg.optimizer.lr_decay_style == "linear"
    assert cfg.optimizer.weight_decay == 0.01 and cfg.optimizer.clip_grad == 1.0
    assert (cfg.optimizer.adam_beta1, cfg.optimizer.adam_beta2, cfg.optimizer.adam_eps) == \
        (0.9, 0.999, 1e-8)
    assert cfg.model.init_method_std == 0.02 and cfg.model.seed == 1234
    assert cfg.model.hidden_dropout == 0.1 and cfg.model.attention_dropout == 0.1
    assert cfg.precision.initial_loss_scale == 2 ** 32 and cfg.precision.hysteresis == 2
    assert cfg.precision.loss_scale_window == 1000 and cfg.precision.min_loss_scale == 1.0
    assert cfg.training.eval_interval == 1000 and cfg.training.eval_iters == 100
    assert cfg.logging.log_interval == 100
    assert cfg.data.split == "969, 30, 1" and cfg.data.dataloader_type == "single"
    assert cfg.model.make_vocab_size_divisible_by == 128
    assert cfg.parallel.ddp_impl == "local" and cfg.model.add_position_embedding
    # Derived values.
    assert cfg.model.ffn_hidden_size == 256 and cfg.model.kv_channels == 8
    assert cfg.training.global_batch_size == 2 and cfg.params_dtype == torch.float32


def test_irregular_megatron_spellings():
    cfg = parse("--DDP-impl torch --no-position-embedding --override-opt_param-scheduler "
                "--no-log-learnig-rate-to-tensorboard --no-query-key-layer-scaling "
                "--bert-no-binary-head --disable-bias-linear --norm-epsilon 1e-6")
    assert cfg.parallel.ddp_impl == "torch" and not cfg.model.add_position_embedding
    assert cfg.optimizer.override_opt_param_scheduler
    assert not cfg.logging.log_learning_rate_to_tensorboard
    assert not cfg.model.apply_query_key_layer_scaling and not cfg.model.bert_binary_head
    assert not cfg.model.add_bias_linear and cfg.model.layernorm_epsilon == 1e-6
    ns = cfg.to_namespace()
    assert ns.DDP_impl == "torch" and ns.num_layers == 4 and ns.data_parallel_size == 1


def test_bf16_forces_fp32_grad_accumulation():
    cfg = parse("--bf16")
    assert cfg.params_dtype == torch.bfloat16 and cfg.precision.accumulate_allreduce_grads_in_fp32


def test_derived_parallel_sizes():
    cfg = parse("--tensor-model-parallel-size 2 --global-batch-size 16", world_size=8)
    assert cfg.data_parallel_size == 4 and cfg.world_size == 8


def test_derived_pipeline_sizes():
    """PP layouts are derived (and checked), virtual stages included."""
    from megatron.config.validate import _derive_parallel_sizes, _derive_pipeline_layers

    cfg = parse_args(BASE + "--pipeline-model-parallel-size 4 --tensor-model-parallel-size 2 "
                     "--num-layers 8 --num-layers-per-virtual-pipeline-stage 1".split(),
                     world_size=16, validate_config=False)
    _derive_parallel_sizes(cfg, 16)
    _derive_pipeline_layers(cfg)
    assert cfg.data_parallel_size == 2 and cfg.virtual_pipeline_model_parallel_size == 2


@pytest.mark.parametrize("extra,world", [
    ("--pipeline-model-parallel-size 2", 2),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
     "--global-batch-size 4", 2),
    ("--pipeline-model-parallel-size 4 --tensor-model-parallel-size 2 --num-layers 8 "
     "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 8", 8),
])
def test_pipeline_layouts_pass(extra, world):
    """PP, PP x VPP (two stages too) and TP x PP are valid layouts."""
    cfg = parse(extra, world_size=world)
    assert cfg.parallel.pipeline_model_parallel_size == int(extra.split()[1])


@pytest.mark.parametrize("extra,world,flags", [
    ("--tensor-model-parallel-size 4", 6, ["world size (6)", "--tensor-model-parallel-size (4)"]),
    ("--pipeline-model-parallel-size 4 --tensor-model-parallel-size 2", 4,
     ["--pipeline-model-parallel-size (4)"]),
    ("--tensor-model-parallel-size 3 --num-attention-heads 8", 3, ["--num-attention-heads (8)"]),
    ("--tensor-model-parallel-size 2 --num-attention-heads 2 --ffn-hidden-size 99", 2,
     ["--ffn-hidden-size (99)"]),
    ("--pipeline-model-parallel-size 3", 3, ["--num-layers (4)", "--pipeline-model-parallel-size (3)"]),
    ("--pipeline-model-parallel-size 4 --num-layers 8 --num-layers-per-virtual-pipeline-stage 3",
     4, ["--num-layers (8)", "--num-layers-per-virtual-pipeline-stage (3)"]),
    # The interleaved schedule needs pipelining (Megatron-LM 23.06 asked for PP > 2; PP = 2
    # runs here: docs/compatibility.md) ...
    ("--num-layers-per-virtual-pipeline-stage 1", 1,
     ["--num-layers-per-virtual-pipeline-stage (1)", "--pipeline-model-parallel-size >= 2"]),
    # ... and a number of micro-batches divisible by PP.
    ("--pipeline-model-parallel-size 4 --num-layers 8 --num-layers-per-virtual-pipeline-stage 1 "
     "--global-batch-size 6", 4, ["micro-batches (3", "--pipeline-model-parallel-size (4)"]),
    # Megatron-LM's remaining pipeline refusals and one combination not built here.
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-split-rank 1", 2,
     ["--pipeline-model-parallel-split-rank", "does not implement"]),
    ("--pipeline-model-parallel-size 2 --standalone-embedding-stage", 2,
     ["--standalone-embedding-stage", "does not implement"]),
    ("--pipeline-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce", 4,
     ["--overlap-grad-reduce", "--untie-embeddings-and-output-weights"]),
    ("--num-layers 0", 1, ["--num-layers (0)", "positive"]),
    ("--hidden-size -8", 1, ["--hidden-size (-8)", "positive"]),
    ("--num-attention-heads 0", 1, ["--num-attention-heads (0)"]),
    ("--global-batch-size 0", 1, ["--global-batch-size (0)"]),
    ("--bf16 --no-contiguous-buffers-in-local-ddp", 1, ["--no-contiguous-buffers-in-local-ddp"]),
    ("--global-batch-size 6", 2, ["--global-batch-size (6)", "--micro-batch-size (2)"]),
    ("--seq-length 128", 1, ["--seq-length (128)", "--max-position-embeddings (64)"]),
    ("--fp16 --bf16", 1, ["--fp16", "--bf16"]),
    ("--train-iters 10 --train-samples 100", 1, ["--train-iters", "--train-samples"]),
    ("--lr 1e-4 --min-lr 1e-3", 1, ["--min-lr", "--lr"]),
    ("--save /tmp/x", 1, ["--save-interval"]),
    ("--batch-size 4", 1, ["--batch-size", "--micro-batch-size"]),
    ("--recompute-granularity full", 1, ["--recompute-method"]),
    ("--fp16-lm-cross-entropy", 1, ["--fp16-lm-cross-entropy"]),
    ("--moe-permute-fusion", 1, ["--moe-permute-fusion", "does not implement"]),
    ("--lr -1", 1, ["--lr (-1.0)", "negative"]),
    ("--overlap-grad-reduce --no-contiguous-buffers-in-local-ddp", 1,
     ["--overlap-grad-reduce", "--no-contiguous-buffers-in-local-ddp"]),
    ("--fp16 --hysteresis 0", 1, ["--hysteresis (0)"]),
    ("--fp16 --loss-scale-window 0", 1, ["--loss-scale-window (0.0)"]),
    ("--fp16 --initial-loss-scale 4 --min-loss-scale 8", 1,
     ["--min-loss-scale (8.0)", "--initial-loss-scale (4.0)"]),
    ("--compile-layers --apply-query-key-layer-scaling --attention-backend unfused", 1,
     ["--compile-layers", "--apply-query-key-layer-scaling", "--attention-backend unfused"]),
])
def test_impossible_combinations_name_the_flags(extra, world, flags, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(extra, world_size=world)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for flag in flags:
        assert flag in err, (flag, err)


@pytest.mark.parametrize("extra,message", [
    ([], "--train-iters or --train-samples"),
    (["--train-iters", "3"], "--lr is required"),
])
def test_training_needs_a_length_and_lr(extra, message, capsys):
    cfg = parse_args(BASE + extra, validate_config=False)
    with pytest.raises(SystemExit) as exc:
        validate_or_exit(cfg, 1, require_train_length=True)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_training_length_and_skip_train_accepted():
    for extra in (["--train-iters", "3", "--lr", "1e-3"], ["--train-samples", "30", "--lr", "1"]):
        cfg = parse_args(BASE + extra, validate_config=False)
        cfg = validate_or_exit(cfg, 1, require_train_length=True)
        assert cfg.checkpoint.no_load_optim is None
    # Evaluation only: no length or --lr needed, and no optimizer state is loaded.
    cfg = parse_args(BASE + ["--skip-train", "--load", "ckpt"], validate_config=False)
    cfg = validate_or_exit(cfg, 1, require_train_length=True)
    assert cfg.checkpoint.no_load_optim is True


def test_missing_architecture_flag():
    with pytest.raises(SystemExit):
        parse_args(["--num-layers", "2"], world_size=1)


@pytest.mark.parametrize("argv", [["--num-layer", "2"], ["--hidden", "8"], ["--no-such-flag"]])
def test_unknown_flags_and_abbreviations_rejected(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + argv, world_size=1)
    assert "unrecognized arguments" in capsys.readouterr().err


def test_extra_args_provider():
    def provider(parser):
        group = parser.add_argument_group("task")
        group.add_argument("--task", default="LAMBADA")
        group.add_argument("--epochs", type=int, default=None)
        return parser

    cfg = parse_args(BASE + ["--epochs", "3"], extra_args_provider=provider, world_size=1)
    assert cfg.extra.epochs == 3 and cfg.extra.task == "LAMBADA"


def test_help_is_grouped_and_documented():
    out = subprocess.run([sys.executable, "-c",
                          "from megatron.config import build_parser; build_parser().print_help()"],
                         capture_output=True, text=True, check=True).stdout
    for _, _, title in SECTIONS:
        assert f"\n{title}:" in out
    assert "Samples per forward/backward pass on one" in " ".join(out.split())


def test_every_field_has_help():
    from megatron.config.base import cli_fields, field_docs

    for _, cls, _ in SECTIONS:
        docs = field_docs(cls)
        undocumented = [f.name for f in cli_fields(cls) if not docs.get(f.name)]
        assert not undocumented, (cls.__name__, undocumented)


def test_field_names_unique_across_sections():
    names = [f.name for _, cls, _ in SECTIONS for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names))


def test_compile_layers_reaches_the_model_config_off_by_default():
    from megatron.config.core_configs import transformer_config

    assert transformer_config(parse()).compile_layers is False
    # Every parallelism and recompute is accepted with it (the one refusal is above).
    cfg = parse("--compile-layers --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                "--sequence-parallel --recompute-granularity full --recompute-method uniform "
                "--bf16", world_size=8)
    assert transformer_config(cfg).compile_layers is True
    assert cfg.to_namespace().compile_layers is True
