"""The language-model input embedding shared by GPT and BERT (Megatron-LM's ``Embedding``):
vocab-parallel word embeddings + learned position embeddings (+ optional token-type
embeddings), transposed to ``[s, b, h]``, then embedding dropout.

The embedding output is replicated on all TP ranks, so its dropout uses the default generator
(identical on all TP ranks, paper appendix B.2). With sequence parallelism each rank keeps its
``s/p`` rows of it, and the dropout on those draws from the per-rank TP stream (as Megatron).
Those rows are a fresh ``[s/p, b, h]`` tensor, never a view that would keep the whole
``[s, b, h]`` alive: with word embeddings alone (no learned positions, no token types) the
vocabulary-parallel lookup is reduce-scattered straight to them (one collective instead of an
all-reduce and a split, Megatron-Core's ``reduce_scatter_embeddings``); otherwise the split rows
are cloned where dropout does not copy them anyway (Megatron's
``clone_scatter_output_in_embedding``).

Legend: b batch, s sequence, h hidden, p TP size.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from megatron.core import device as device_mod
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.core.tensor_parallel.utils import ProcessGroup, set_defaults_if_not_set
from megatron.core.transformer.config import TransformerConfig


def _replicated_embedding(num: int, dim: int, init_method: tp_layers.InitMethod,
                          params_dtype: torch.dtype) -> torch.nn.Embedding:
    """A plain embedding drawn on the CPU from the default generator (same on all TP ranks)."""
    master = torch.empty(num, dim, dtype=tp_layers.master_dtype(params_dtype), device="cpu")
    init_method(master)
    weight = master.to(params_dtype).to(device_mod.get_device())
    emb = torch.nn.Embedding.from_pretrained(weight, freeze=False)
    set_defaults_if_not_set(emb.weight)
    return emb


class Embedding(torch.nn.Module):
    """Word (+ position) (+ token-type) embeddings. State-dict names: ``word_embeddings``,
    ``position_embeddings``, ``tokentype_embeddings``.

    Args:
        config: needs ``padded_vocab_size``, ``hidden_size``, ``max_position_embeddings``
            (when ``add_position_embedding``), ``num_tokentypes``, ``hidden_dropout``.
        tp_group: the TP process group.
    """

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None) -> None:
        super().__init__()
        if config.padded_vocab_size is None:
            raise ValueError("TransformerConfig.padded_vocab_size is unset: build the tokenizer "
                             "first (it sets cfg.padded_vocab_size)")
        init = tp_layers.init_method_normal(config.init_method_std)
        h, dtype = config.hidden_size, config.params_dtype
        self.hidden_dropout = config.hidden_dropout
        self.tp_group, self.sequence_parallel = tp_group, config.sequence_parallel
        # Sequence parallel with word embeddings alone: the lookup's partial sums are
        # reduce-scattered to this rank's rows at once.
        self.reduce_scatter_embeddings = config.sequence_parallel and not (
            config.add_position_embedding
            and config.position_embedding_type == "learned_absolute") \
            and config.num_tokentypes <= 0
        self.word_embeddings = tp_layers.VocabParallelEmbedding(
            config.padded_vocab_size, h, tp_group=tp_group, init_method=init, params_dtype=dtype,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings,
            **tp_layers.init_options(config))
        self.position_embeddings = None
        if config.add_position_embedding and config.position_embedding_type == "learned_absolute":
            self.position_embeddings = _replicated_embedding(
                config.max_position_embeddings, h, init, dtype)
        self.tokentype_embeddings = None
        if config.num_tokentypes > 0:
            self.tokentype_embeddings = _replicated_embedding(config.num_tokentypes, h, init,
                                                              dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids [b, s]`` -> ``[s, b, h]`` (``[s/p, b, h]``, this rank's rows, with
        sequence parallelism)."""
        if self.reduce_scatter_embeddings:
            emb = self.word_embeddings(input_ids)  # [s/p, b, h], reduce-scattered
            if tokentype_ids is not None:
                raise ValueError("tokentype_ids given but the model has num_tokentypes = 0")
            return self._sequence_dropout(emb)
        emb = self.word_embeddings(input_ids)  # [b, s, h]
        if self.position_embeddings is not None:
            emb = emb + self.position_embeddings(position_ids)
        if tokentype_ids is not None:
            if self.tokentype_embeddings is None:
                raise ValueError("tokentype_ids given but the model has num_tokentypes = 0")
            emb = emb + self.tokentype_embeddings(tokentype_ids)
        emb = emb.transpose(0, 1).contiguous()  # [s, b, h]
        if not self.sequence_parallel:
            return F.dropout(emb, p=self.hidden_dropout, training=self.training)
        emb = scatter_to_sequence_parallel_region(emb, self.tp_group)  # [s/p, b, h], a view
        if not (self.training and self.hidden_dropout > 0):
            emb = emb.clone()  # dropout would copy it; without, free the whole [s, b, h]
        return self._sequence_dropout(emb)

    def _sequence_dropout(self, emb: torch.Tensor) -> torch.Tensor:
        """Dropout of this rank's ``[s/p, b, h]`` rows, from the per-rank TP stream."""
        drop = self.training and self.hidden_dropout > 0
        with get_rng_tracker().fork() if drop else contextlib.nullcontext():
            return F.dropout(emb, p=self.hidden_dropout, training=self.training)
