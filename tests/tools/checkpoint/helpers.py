"""Tiny models and their checkpoints, written as Megatron-LM (or another tool) writes them."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from megatron.checkpointing import (checkpoint_dir, checkpoint_name, flatten_model_state,
                                    load_checkpoint_file, publish_tracker, save_file,
                                    shard_files)
from megatron.core.models.bert import BertModel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.config import TransformerConfig

HIDDEN, HEADS, MAX_POSITIONS = 16, 4, 32


def config(num_layers: int = 4, vocab: int = 264, **kwargs) -> TransformerConfig:
    args = dict(num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                padded_vocab_size=vocab, max_position_embeddings=MAX_POSITIONS,
                hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
                init_method_std=0.2)
    args.update(kwargs)
    return TransformerConfig(**args)


def gpt(seed: int = 3, **kwargs) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config(**kwargs), None).eval()


def bert(seed: int = 3, **kwargs) -> BertModel:
    torch.manual_seed(seed)
    model = BertModel(config(num_tokentypes=2, **kwargs), None).eval()
    with torch.no_grad():  # the LM head's bias starts at zero: give it values to move around
        model.lm_head.bias.normal_()
    return model


def args_of(model, iteration: int = 7, **extra) -> argparse.Namespace:
    c = model.config
    values = dict(num_layers=c.num_layers, hidden_size=c.hidden_size,
                  num_attention_heads=c.num_attention_heads, ffn_hidden_size=c.ffn_hidden_size,
                  kv_channels=c.kv_channels, max_position_embeddings=c.max_position_embeddings,
                  padded_vocab_size=c.padded_vocab_size, make_vocab_size_divisible_by=8,
                  tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                  untie_embeddings_and_output_weights=c.untie_embeddings_and_output_weights,
                  tokenizer_type="NullTokenizer", vocab_size=255, bias_gelu_fusion=True,
                  add_bias_linear=True, openai_gelu=False, layernorm_epsilon=1e-5,
                  iteration=iteration, consumed_train_samples=56)
    values.update(extra)
    return argparse.Namespace(**values)


def save_single(root: Path, model, args, iteration: int = 7, **top) -> Path:
    """``model`` as a TP1.PP1 Megatron checkpoint under ``root`` (with tracker)."""
    sd = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
          "model": model.state_dict_for_save_checkpoint(), "optimizer": {"state": {}}}
    sd.update(top)
    path = checkpoint_name(root, iteration)
    save_file(sd, path)
    publish_tracker(Path(root), iteration, checkpoint_dir(root, iteration))
    return path


def shards(iteration_dir: Path) -> dict[tuple[int, int], dict]:
    return {rank: load_checkpoint_file(path) for rank, path in shard_files(iteration_dir).items()}


def flat_model(sd: dict, key: str = "model") -> dict[str, torch.Tensor]:
    return flatten_model_state(sd[key])


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b), sorted(set(a) ^ set(b))
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def flatten(model_state: dict) -> dict[str, torch.Tensor]:
    return flatten_model_state(model_state)


def assert_equal_nested(a, b, where: str = "") -> None:
    """Nested dicts / lists / tensors equal bit for bit (dtype too); ``where`` names a path."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for key in a:
            assert_equal_nested(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_nested(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)
