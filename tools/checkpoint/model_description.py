"""The in-memory model description between a loader and a saver (Megatron-LM's
``tools/checkpoint`` queue messages, as a pull interface).

A loader describes one model: its architecture (``args``, Megatron's argparse names), the
iteration, and three kinds of pieces, each a dict of *whole* tensors (no TP split) under the
dotted keys of ``megatron.checkpointing.layout`` with *global* layer numbers and the source's
padded vocabulary:

* :meth:`ModelDescription.embeddings` -- ``language_model.embedding.*``;
* :meth:`ModelDescription.layer` ``(i)`` -- ``language_model.encoder.layers.i.*``, QKV rows in
  Megatron's current grouped order ``[g, np/g + 2, hn]`` (g key/value groups: per group its
  np/g query heads, then its key and its value head; without grouped-query attention g = np,
  i.e. ``[np, 3, hn]``);
* :meth:`ModelDescription.head` -- the final LayerNorm, the untied output layer and BERT's
  pooler / ``lm_head`` / ``binary_head``.

With the optimizer state kept (``--keep-optimizer-state``), :attr:`ModelDescription.optimizer`
describes its global part and :meth:`ModelDescription.optimizer_state` gives each piece's
per-parameter tensors, whole and under the same keys (``tools.checkpoint.optimizer_state``).

A saver pulls the pieces in whatever order it writes (a pipeline stage at a time, layer by
layer); a loader keeps only what the current piece needs (one source pipeline stage, mapped
from its files), so a conversion never holds a whole-model copy.
"""

from __future__ import annotations

import abc
import argparse
import copy
import re
from dataclasses import dataclass, field

import torch

from tools.checkpoint.optimizer_state import OptimizerDescription

WORD_EMBEDDINGS = "language_model.embedding.word_embeddings.weight"
OUTPUT_LAYER = "language_model.output_layer.weight"
LM_HEAD_BIAS = "lm_head.bias"
VOCAB_ROWS = (WORD_EMBEDDINGS, OUTPUT_LAYER, LM_HEAD_BIAS)
"""Tensors whose dim 0 is the padded vocabulary."""


@dataclass
class ModelDescription(abc.ABC):
    """One model, described for a saver. Subclasses (loaders) implement the three pieces."""

    family: str
    """``GPT`` or ``BERT`` (a key of ``megatron.checkpointing.LAYOUTS``)."""
    args: argparse.Namespace
    """Megatron's args: architecture (``num_layers``, ``hidden_size``...), parallel sizes of the
    source, training counters (``consumed_train_samples``...)."""
    iteration: int = 0
    release: bool = False
    true_vocab_size: int | None = None
    """The tokenizer's vocabulary before padding, when known (rows past it are padding)."""
    repad: bool = False
    """The source's vocabulary is unpadded (a HuggingFace model): a Megatron saver pads it to
    ``make_vocab_size_divisible_by`` x TP as a Megatron run would."""
    extra: dict = field(default_factory=dict)
    """Other top-level entries a Megatron saver carries over (``rng_state``,
    ``num_floating_point_operations_so_far``)."""
    optimizer: OptimizerDescription | None = None
    """The optimizer's step count, options, grad scaler and LR scheduler, when the state is
    carried (None: dropped)."""

    @property
    def num_layers(self) -> int:
        return int(self.args.num_layers)

    @property
    def padded_vocab_size(self) -> int:
        return int(self.args.padded_vocab_size)

    @property
    def untied(self) -> bool:
        return bool(getattr(self.args, "untie_embeddings_and_output_weights", False))

    def args_copy(self) -> argparse.Namespace:
        return copy.deepcopy(self.args)

    @abc.abstractmethod
    def embeddings(self) -> dict[str, torch.Tensor]:
        """``language_model.embedding.*``, whole tensors."""

    @abc.abstractmethod
    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer ``index``'s tensors under ``language_model.encoder.layers.{index}.*``."""

    @abc.abstractmethod
    def head(self) -> dict[str, torch.Tensor]:
        """The last stage's tensors (final LayerNorm, untied output layer, BERT heads)."""

    def optimizer_state(self, piece: str, layer: int | None = None
                        ) -> dict[str, dict[str, torch.Tensor]]:
        """The per-parameter optimizer state of a piece (``"embeddings"``, ``"layer"`` with
        ``layer``, ``"head"``): ``{state key: {model key: whole tensor}}``."""
        raise ValueError(f"the {type(self).__name__} loader carries no optimizer state")

    def close(self) -> None:
        """Drop what the loader holds (mapped files)."""


def repad_vocab(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with dim 0 cut to ``rows``, or grown to it by copies of its last row, as
    Megatron-LM's converter pads a new vocabulary (and HuggingFace's). A padding token is never
    an input, but its logit is in every softmax: zero rows give it logit 0, far above what
    training leaves a padding token, and raise the loss; a copy of a trained row does not."""
    have = tensor.shape[0]
    if have == rows:
        return tensor
    if have > rows:
        return tensor[:rows].clone()
    pad = tensor[-1:].expand(rows - have, *tensor.shape[1:])
    return torch.cat([tensor, pad], dim=0)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron's ``_vocab_size_with_padding``: the smallest multiple of ``divisible_by`` x TP
    that holds ``vocab_size``."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


SWIGLU_FC1 = ("mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")
"""The SwiGLU fc1 tensors: each TP rank r holds [gate_r; up_r], the whole tensor [gate; up]
(the dense MLP's, and each MoE expert's and the shared experts')."""
_SWIGLU_FC1_ANYWHERE = re.compile(r"\.mlp\.(?:local_experts\.\d+\.|shared_experts\.)?"
                                  r"dense_h_to_4h\.(?:weight|bias)$")


def is_swiglu_fc1(key: str) -> bool:
    """``key`` is an fc1 of the dense MLP, of a routed expert or of the shared experts."""
    return _SWIGLU_FC1_ANYWHERE.search(key) is not None


def _swiglu_rows(t: torch.Tensor, tp: int, to_whole: bool) -> torch.Tensor:
    """Reorder fc1's rows between the concatenated TP shards ``[gate_0; up_0; gate_1; up_1
    ...]`` and the whole ``[gate; up]`` (``to_whole``), or back."""
    if tp == 1:
        return t
    rest = t.shape[1:]
    shape = (tp, 2, -1, *rest) if to_whole else (2, tp, -1, *rest)
    return t.reshape(shape).transpose(0, 1).reshape(t.shape).contiguous()


def swiglu_from_shards(piece: dict[str, torch.Tensor], tp: int) -> dict[str, torch.Tensor]:
    """A piece merged from ``tp`` ranks by concatenation, with its SwiGLU fc1 made whole."""
    return {k: _swiglu_rows(v, tp, True) if is_swiglu_fc1(k) else v
            for k, v in piece.items()}


def swiglu_for_shards(piece: dict[str, torch.Tensor], tp: int) -> dict[str, torch.Tensor]:
    """A whole piece with its SwiGLU fc1 ordered so that a contiguous split over ``tp`` ranks
    gives each rank its [gate_r; up_r]."""
    return {k: _swiglu_rows(v, tp, False) if is_swiglu_fc1(k) else v
            for k, v in piece.items()}
