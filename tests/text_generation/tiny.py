"""A tiny GPT and a byte-level tokenizer for the text generation tests (no files needed)."""

from __future__ import annotations

import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.config import TransformerConfig

MAX_POSITIONS = 96


class ByteTokenizer:
    """Each UTF-8 byte is a token (0..255); 256 is the end of document."""

    eod = 256
    vocab_size = 257

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            out += b"<|endoftext|>" if i == self.eod else bytes([i])
        return out.decode("utf-8", errors="replace")


def tiny_config(dtype: torch.dtype = torch.float64, **kwargs) -> TransformerConfig:
    args = dict(num_layers=2, hidden_size=16, num_attention_heads=4, padded_vocab_size=264,
                max_position_embeddings=MAX_POSITIONS, hidden_dropout=0.0,
                attention_dropout=0.0, params_dtype=dtype, init_method_std=0.5)
    args.update(kwargs)
    return TransformerConfig(**args)


def tiny_model(tp_group=None, seed: int = 5, **kwargs) -> GPTModel:
    """The same weights at any TP size (one seed, TP-invariant init)."""
    torch.manual_seed(seed)
    return GPTModel(tiny_config(**kwargs), tp_group).eval()


def tiny_stage(tp_group, pp_rank: int, pp_size: int, seed: int = 5, **kwargs) -> GPTModel:
    """This pipeline stage of :func:`tiny_model` (same weights: its layers and, on the last
    stage, the tied output weight are copied from the whole model)."""
    full = tiny_model(tp_group, seed, **kwargs)
    config = tiny_config(**kwargs)
    per_stage = config.num_layers // pp_size
    offset = pp_rank * per_stage
    stage = GPTModel(config, tp_group, pre_process=pp_rank == 0,
                     post_process=pp_rank == pp_size - 1, num_layers=per_stage,
                     layer_offset=offset).eval()
    whole = full.state_dict()
    own = {}
    for name in stage.state_dict():
        source = name
        if name.startswith("language_model.encoder.layers."):
            rest = name[len("language_model.encoder.layers."):]
            index, tail = rest.split(".", 1)
            source = f"language_model.encoder.layers.{int(index) + offset}.{tail}"
        elif name == "word_embeddings.weight":  # the last stage's copy of the tied embedding
            source = "language_model.embedding.word_embeddings.weight"
        own[name] = whole[source]
    stage.load_state_dict(own)
    return stage
