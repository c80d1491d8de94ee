"""The lower layers' configs are filled from the flags by name, and the validated config is final.

``megatron.config.core_configs`` copies each lower config's fields from the same-named flags; a
field no flag provides must be one its builder passes on purpose, and where both declare a
default the two agree (a library user and a CLI user start from the same model and optimizer).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.config import parse_args
from megatron.config.cli import build_parser, parse_flags, validate_or_exit
from megatron.config.core_configs import flag_values, optimizer_config, transformer_config
from megatron.core.distributed.config import DistributedDataParallelConfig
from megatron.core.optimizer.config import OptimizerConfig
from megatron.core.transformer.config import TransformerConfig

BASE = ("--num-layers 2 --hidden-size 16 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --train-iters 1 --lr 1e-3 "
        "--mock-data").split()

# Fields that no flag provides, on purpose: who fills them.
NOT_FROM_FLAGS = {
    # num_tokentypes: the model builder (BERT: 2, GPT: 0); num_moe_experts: --num-experts under
    # Megatron-Core's field name (core_configs passes it by hand).
    TransformerConfig: {"num_tokentypes", "num_moe_experts"},
    OptimizerConfig: set(),
    DistributedDataParallelConfig: {"check_for_nan_in_grad"},  # from the NaN-check flag and fp16
}


def is_read_only(obj) -> bool:
    return bool(obj.__dict__.get("_read_only"))


def unmapped_fields(cls: type, cfg) -> list[str]:
    values = flag_values(cfg)
    return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in values]


@pytest.mark.parametrize("cls", list(NOT_FROM_FLAGS))
def test_every_lower_field_comes_from_a_flag(cls):
    assert set(unmapped_fields(cls, parse_args(BASE))) == NOT_FROM_FLAGS[cls]


@pytest.mark.parametrize("cls", list(NOT_FROM_FLAGS))
def test_lower_defaults_agree_with_flag_defaults(cls):
    flags = parse_flags(build_parser(), [])  # every flag at its default, not validated
    values = flag_values(flags)
    differ = {f.name: (f.default, values[f.name]) for f in dataclasses.fields(cls)
              if f.name in values and f.default is not dataclasses.MISSING
              and None not in (f.default, values[f.name]) and f.default != values[f.name]}
    assert not differ, differ


def test_values_are_copied_by_name():
    cfg = parse_args(BASE + ["--bf16", "--adam-beta2", "0.95", "--attention-dropout", "0.0",
                             "--use-distributed-optimizer", "--recompute-activations"])
    opt, model = optimizer_config(cfg), transformer_config(cfg)
    assert (opt.adam_beta2, opt.bf16, opt.params_dtype, opt.use_distributed_optimizer) == \
        (0.95, True, torch.bfloat16, True)
    assert (model.attention_dropout, model.params_dtype, model.recompute_granularity) == \
        (0.0, torch.bfloat16, "selective")
    assert model.padded_vocab_size == cfg.padded_vocab_size == 50304  # derived by validate()


def test_validated_config_is_read_only_and_flags_untouched():
    parser = build_parser()
    flags = parse_flags(parser, BASE)
    cfg = validate_or_exit(flags, 1, parser=parser)
    assert is_read_only(cfg) and is_read_only(cfg.model) and not is_read_only(flags)
    # validate() derived values on its copy only.
    assert flags.model.ffn_hidden_size is None and cfg.model.ffn_hidden_size == 64
    assert flags.tokenizer.tokenizer_type is None
    assert cfg.tokenizer.tokenizer_type == "NullTokenizer"
    for write in (lambda: setattr(cfg.model, "hidden_size", 32),
                  lambda: setattr(cfg, "padded_vocab_size", 1),
                  lambda: setattr(cfg.tokenizer, "vocab_size", 7)):
        with pytest.raises(dataclasses.FrozenInstanceError, match="read-only"):
            write()


def test_padded_vocab_size_is_derived_at_validation(shared_data):
    tok = shared_data / "tokenizers"
    argv = [a for a in BASE if a != "--mock-data"] + [
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "gpt2-vocab.json"),
        "--merge-file", str(tok / "gpt2-merges.txt"), "--make-vocab-size-divisible-by", "64"]
    assert parse_args(argv, world_size=2).padded_vocab_size == 50304  # 50257 -> multiple of 64
    tp2 = parse_args(argv + ["--tensor-model-parallel-size", "2"], world_size=2)
    assert tp2.padded_vocab_size == 50304  # multiple of 64 x 2 = 128 as well


@dataclasses.dataclass(kw_only=True)
class _ToolFlags:
    """A script's own flags."""

    beams: int = 1
    """Beam count."""


def test_tool_sections_are_typed_and_saved_with_the_args():
    cfg = parse_args(BASE + ["--beams", "4"], tool_sections=[(_ToolFlags, "tool")])
    assert cfg.section(_ToolFlags) == _ToolFlags(beams=4)
    assert cfg.to_namespace().beams == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.section(_ToolFlags).beams = 2
