"""The base of Megatron's language models (GPT; BERT builds on it too): the embedding + encoder
stack, the output weight tied to the word embedding across pipeline stages, Megatron-LM's legacy
checkpoint layout and its strict loading report.

Pipeline stages (Megatron's ``initialize_word_embeddings``), with tied embeddings:

* one stage (``pre_process`` and ``post_process``): the logits use the embedding Parameter itself;
* first stage (``pre_process`` only): owns the word embedding, marked ``shared_embedding``;
* last stage (``post_process`` only): its own copy, ``word_embeddings`` (checkpoint key
  ``word_embeddings_for_head``), created as zeros and marked ``shared`` (a duplicate: the grad
  norm skips it); :func:`initialize_word_embeddings` sums it with stage 0's embedding over the
  embedding group so both start equal, and ``finalize_model_grads`` sums their gradients;
* middle stages: no output weight.

Subclasses own their ``forward`` (the mask they build, the head on the last stage) and name
their checkpoint sections beside ``language_model`` in
:meth:`LanguageModule.extra_state_dict_sections` (BERT's ``lm_head``, ``binary_head``; its pooler
belongs inside ``language_model``, key ``language_model.pooler.*``). A model without an output
layer over the vocabulary (a finetuning head) sets :attr:`LanguageModule.has_lm_output` False:
no tied weight, no head copy. Keys and their old names: :mod:`megatron.core.checkpoint_keys`;
building a rank's stage: :mod:`megatron.core.models.builder`.

Legend: s sequence, b batch, h hidden, V padded vocabulary, p TP size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from megatron.core import comm
from megatron.core.checkpoint_keys import HEAD_COPY_SECTION, flatten_checkpoint_state_dict
from megatron.core.models.language_model import TransformerLanguageModel
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.utils import ProcessGroup, set_defaults_if_not_set
from megatron.core.transformer.config import AttnMaskType, TransformerConfig
from megatron.core.transformer.moe.moe_layer import ExpertGroups


class LanguageModule(torch.nn.Module):
    """Embedding, transformer and tied output weight of one pipeline stage, split over TP ranks.

    Args:
        config: transformer + language-model settings (``padded_vocab_size`` required).
        tp_group: the TP process group (``None`` = this rank alone: no tensor parallelism).
        pre_process: first pipeline stage (holds the embedding).
        post_process: last pipeline stage (final LayerNorm, the model's head).
        parallel_output: logits stay vocab-split ``[b, s, V/p]`` (else gathered ``[b, s, V]``).
        num_layers: layers on this stage (default all).
        layer_offset: global index of this stage's first layer.
        add_pooler: the language model's last stage also pools the first position (BERT).
    """

    checkpoint_name: ClassVar[str] = "language model"
    """Names the model in loading errors ("GPT checkpoint does not fit the model")."""
    attn_mask_type: ClassVar[AttnMaskType] = "causal"
    replicated_head: ClassVar[bool] = False
    """The last stage's head is replicated over TP ranks and reads the whole sequence (BERT):
    with sequence parallelism the language model all-gathers its output for it."""
    has_lm_output: ClassVar[bool] = True
    """The last stage projects onto the vocabulary (GPT's logits, BERT's LM head); with tied
    embeddings through the word embedding's weight. False: no such layer (a finetuning head)."""

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None, *,
                 pre_process: bool = True, post_process: bool = True,
                 parallel_output: bool = True, num_layers: int | None = None,
                 layer_offset: int = 0, add_pooler: bool = False,
                 cp_group: ProcessGroup | None = None,
                 expert_groups: ExpertGroups | None = None) -> None:
        super().__init__()
        self.config, self.tp_group = config, tp_group
        self.pre_process, self.post_process = pre_process, post_process
        self.parallel_output = parallel_output
        # Read by finalize_model_grads (embedding-group all-reduce with PP > 1).
        self.share_embeddings_and_output_weights = \
            self.has_lm_output and not config.untie_embeddings_and_output_weights
        self.language_model = TransformerLanguageModel(
            config, tp_group, pre_process=pre_process, post_process=post_process,
            num_layers=num_layers, layer_offset=layer_offset,
            attn_mask_type=self.attn_mask_type, add_pooler=add_pooler,
            replicated_head=self.replicated_head, cp_group=cp_group,
            expert_groups=expert_groups)
        self.word_embeddings = self._init_word_embeddings()
        self.set_parameter_defaults()

    def _init_word_embeddings(self) -> tp_layers.VocabParallelEmbedding | None:
        """Megatron's ``initialize_word_embeddings`` up to its collective: marks stage 0's
        embedding when a later stage has a twin, and returns the last stage's own copy
        (``word_embeddings_for_head``), or None."""
        if not self.share_embeddings_and_output_weights:
            return None
        if self.pre_process and not self.post_process:
            # Stage 0 of several: its embedding has a twin on the last stage.
            self.language_model.embedding.word_embeddings.weight.shared_embedding = True
        if not self.post_process or self.pre_process:
            return None
        c = self.config
        # Zeros: initialize_word_embeddings sums stage 0's weight into it (zeros draw nothing
        # from the generator, so the other stages' init is unchanged).
        copy = tp_layers.VocabParallelEmbedding(
            c.padded_vocab_size, c.hidden_size, tp_group=self.tp_group,
            init_method=torch.nn.init.zeros_, params_dtype=c.params_dtype)
        # A duplicate of stage 0's weight: grad-norm code skips `shared` params. With one stage
        # the logits use the embedding Parameter itself, which is not a duplicate and so is not
        # marked (marking it would drop it from the grad norm).
        copy.weight.shared = True
        copy.weight.shared_embedding = True
        return copy

    def set_parameter_defaults(self) -> None:
        """Give every parameter the TP attributes the optimizer reads (replicated unless set).
        Subclasses that add modules after ``__init__`` call it again (it keeps set values)."""
        for param in self.parameters():
            set_defaults_if_not_set(param)

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter | None:
        """The weight of the logits projection's vocabulary side on this stage (or None)."""
        if self.pre_process:
            return self.language_model.embedding.word_embeddings.weight
        if self.word_embeddings is not None:
            return self.word_embeddings.weight
        if self.language_model.output_layer is not None:
            return self.language_model.output_layer.weight
        return None

    def output_weight(self) -> torch.nn.Parameter:
        """The ``[V/p, h]`` weight of the logits projection (last stage only)."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.language_model.output_layer.weight

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """Activation from the previous pipeline stage (``[s, b, h]``)."""
        self.language_model.set_input_tensor(input_tensor)

    # Loss ----------------------------------------------------------------------------------
    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Unreduced vocab-parallel cross entropy of ``logits [..., V/p]`` against ``targets
        [...]``, in fp32 (or wider) unless ``fp16_lm_cross_entropy``.

        ``logits`` are overwritten: pass a temporary nobody else reads (the output layer's
        backward needs only its input and weight).
        """
        loss_dtype = None  # the logits' (float64 stays float64)
        if logits.dtype in (torch.float16, torch.bfloat16) and not \
                self.config.fp16_lm_cross_entropy:
            # The loss in fp32: the fused kernel reads the half logits and computes in fp32
            # (no fp32 copy of the [s, b, V/p] logits); the unfused path upcasts them.
            loss_dtype = torch.float32
        return vocab_parallel_cross_entropy(logits, targets, self.tp_group, inplace=True,
                                            loss_dtype=loss_dtype)

    # Checkpoint layout ---------------------------------------------------------------------
    def state_dict_for_save_checkpoint(self) -> dict:
        """Megatron-LM's legacy nested model dict (``sd['model']`` of ``model_optim_rng.pt``):
        ``language_model``, the subclass's sections, then ``word_embeddings_for_head``."""
        out = {"language_model": self.language_model.state_dict_for_save_checkpoint()}
        out.update(self.extra_state_dict_sections())
        if self.word_embeddings is not None:
            out[HEAD_COPY_SECTION] = self.word_embeddings.state_dict()
        return out

    def extra_state_dict_sections(self) -> dict[str, dict]:
        """Checkpoint sections beside ``language_model``, named as the submodules that load
        them (e.g. ``{"lm_head": self.lm_head.state_dict()}``); none here."""
        return {}

    def load_state_dict(self, state_dict: Mapping, strict: bool = True, assign: bool = False):
        """Load the nested checkpoint layout (also old ``transformer``/``.attention.`` names) or
        this module's flat ``state_dict()``.

        Raises:
            ValueError: with ``strict``, missing or unexpected keys or shape mismatches, all
                listed (and, without ``strict``, shape mismatches).
        """
        flat = flatten_checkpoint_state_dict(state_dict)
        if self.word_embeddings is None:
            # A head copy beside a stage that has none (converters write one even for a single
            # stage): Megatron-LM's legacy model loads it only on a last stage without the
            # embedding, and ignores it elsewhere.
            flat.pop("word_embeddings.weight", None)
        own = self.state_dict()
        problems = checkpoint_fit_problems(flat, own, strict)
        if problems:
            raise ValueError(f"{self.checkpoint_name} checkpoint does not fit the model:\n  "
                             + "\n  ".join(problems))
        flat = {k: v for k, v in flat.items() if k in own}
        return super().load_state_dict(flat, strict=strict, assign=assign)


def checkpoint_fit_problems(flat: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor],
                            strict: bool) -> list[str]:
    """Every reason the flat checkpoint dict ``flat`` cannot load into a model whose
    ``state_dict()`` is ``own``: missing/unexpected keys (with ``strict``), shape mismatches."""
    missing = sorted(set(own) - set(flat))
    unexpected = sorted(set(flat) - set(own))
    mismatched = [f"{k}: checkpoint {tuple(flat[k].shape)} vs model {tuple(own[k].shape)}"
                  for k in sorted(set(own) & set(flat)) if flat[k].shape != own[k].shape]
    problems = []
    if strict and missing:
        problems.append("missing keys: " + ", ".join(missing))
    if strict and unexpected:
        problems.append("unexpected keys: " + ", ".join(unexpected))
    if mismatched:
        problems.append("shape mismatches (wrong TP size or model shape?): "
                        + "; ".join(mismatched))
    return problems


def initialize_word_embeddings(model: LanguageModule, embedding_group: ProcessGroup | None
                               ) -> None:
    """Make the last stage's copy of the tied word embedding equal to stage 0's (Megatron's
    ``initialize_word_embeddings``, collective part): the copy is zeros, so summing over the
    embedding group (first and last stage of a pipeline, same TP rank) gives every member stage
    0's values exactly. Call on every member of ``embedding_group``, once, after building.
    """
    if not model.share_embeddings_and_output_weights:
        return
    weight = model.shared_embedding_or_output_weight()
    if weight is None:
        return  # a middle stage: not in the embedding group
    comm.all_reduce(weight.data, embedding_group, "sum")
