"""BERT with a finetuning head instead of its pretraining heads: every task head, in one place
(Megatron-LM's ``megatron/model/classification.py`` and ``multiple_choice.py``; SQuAD's span
head as Google's ``run_squad.py`` and HF's ``BertForQuestionAnswering``).

* :class:`Classification` (GLUE): pooler -> dropout(``hidden_dropout``) ->
  ``Linear(h, classes)``; checkpoint key ``classification_head``.
* :class:`MultipleChoice` (RACE): inputs ``[b, choices, s]`` run as ``[b choices, s]``; pooler
  -> dropout -> ``Linear(h, 1)`` -> ``view(-1, choices)``; checkpoint key ``multichoice_head``.
* :class:`QuestionAnswering` (SQuAD): ``Linear(h, 2)`` over every position of the final hidden
  states, a start and an end logit per token; no pooler (the span head reads every position,
  not [CLS]'s pooled vector) and no dropout before the head (as both recipes); checkpoint key
  ``qa_head``.

Each is a :class:`BertWithHead`: the :class:`~megatron.core.models.bert.BertBody` (embedding
with token types, padding-masked encoder, final LayerNorm, pooler; ``language_model.*`` as in a
pretrained BERT checkpoint) and a replicated head on the last stage. There is no masked-LM head,
so no tied output weight either (``has_lm_output = False``).

Loading (``load_state_dict``) has two modes, as Megatron-LM's finetuning uses them:

* ``strict=True`` (resuming a finetuning run, ``--load``): every key must fit.
* ``strict=False`` (a pretrained BERT, ``--pretrained-checkpoint``): only ``language_model`` is
  read; the pretraining heads (``lm_head``, ``binary_head``, ``word_embeddings_for_head``) are
  dropped, and what the checkpoint lacks (the new head; the pooler and token-type embedding of
  a BERT pretrained with ``--bert-no-binary-head``) keeps its fresh initialization; each is
  logged. Any other body weight missing or left over (another depth) is an error, as in
  Megatron-LM's strict body load; another task's head is ignored. Shape mismatches are errors
  in both modes.

Another head subclasses :class:`BertWithHead` the same way: build the head in ``build_head``,
apply it in ``head``, name its checkpoint section in ``head_key`` (``pooled`` is None with
``add_pooler=False``).

Legend: b batch, c choices, s sequence, h hidden, k classes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron.core.checkpoint_keys import HEAD_COPY_SECTION, flatten_checkpoint_state_dict
from megatron.core.log import log_rank_0
from megatron.core.models.bert import BertBody
from megatron.core.models.language_model import replicated_linear
from megatron.core.tensor_parallel.utils import ProcessGroup
from megatron.core.transformer.config import TransformerConfig

__all__ = ["BertWithHead", "Classification", "MultipleChoice", "NUM_CHOICES",
           "QuestionAnswering"]

NUM_CHOICES = 4
"""Choices per RACE question."""

_PRETRAINING_SECTIONS = ("lm_head", "binary_head", HEAD_COPY_SECTION)
"""Checkpoint sections of a pretrained BERT that a finetuning model has no use for."""

_OPTIONAL_BODY = ("language_model.pooler.", "language_model.embedding.tokentype_embeddings.")
"""Body parts a pretrained BERT may lack (``--bert-no-binary-head``) or a model may not use
(a head without pooler); every other body weight must be in the checkpoint."""


class BertWithHead(BertBody):
    """The BERT body (with pooler unless ``add_pooler=False``) and one task head on the last
    stage; ``forward(input_ids [b, s], padding_mask [b, s], tokentype_ids [b, s])``.

    Args:
        config: transformer settings; ``num_tokentypes`` should be 2 (Megatron-LM's finetuning
            models always have two token types).
        tp_group: the TP process group.
        add_pooler: build the pooler (first position -> dense -> tanh).
        kwargs: see :class:`LanguageModule` (``pre_process``, ``post_process``, ...).
    """

    checkpoint_name = "BERT finetuning"
    has_lm_output = False
    head_key = "head"
    """The head's checkpoint section (Megatron-LM's ``_classification_head_key``...)."""

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None, *,
                 add_pooler: bool = True, **kwargs) -> None:
        super().__init__(config, tp_group, add_pooler=add_pooler, **kwargs)
        self.head_dropout = None
        if self.post_process:
            # A plain Dropout on the replicated pooled output: the default generator, which
            # every TP rank seeds alike, so TP ranks drop the same elements.
            self.head_dropout = torch.nn.Dropout(config.hidden_dropout)
            self.build_head(config)
        self.set_parameter_defaults()

    def build_head(self, config: TransformerConfig) -> None:
        """Create the head's modules (last stage only)."""
        raise NotImplementedError

    def head(self, hidden: torch.Tensor, pooled: torch.Tensor | None) -> torch.Tensor:
        """``hidden [s, b, h]``, ``pooled [b, h]`` -> the task's logits."""
        raise NotImplementedError

    def head_module(self) -> torch.nn.Module:
        """The module saved under :attr:`head_key`."""
        return getattr(self, self.head_key)

    def forward(self, input_ids: torch.Tensor | None, padding_mask: torch.Tensor,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``, ``padding_mask`` (1 = real token), ``tokentype_ids``: ``[b, s]``.
        Returns the head's logits on the last stage, the hidden ``[s, b, h]`` elsewhere."""
        output = self.encode(input_ids, padding_mask, tokentype_ids)
        if not self.post_process:
            return output
        return self.head(*output)

    def extra_state_dict_sections(self) -> dict[str, dict]:
        if not self.post_process:
            return {}
        return {self.head_key: self.head_module().state_dict()}

    def load_state_dict(self, state_dict: Mapping, strict: bool = True, assign: bool = False):
        """See the module docstring (``strict=False``: a pretrained BERT).

        Raises:
            ValueError: with ``strict``, missing or unexpected keys; shape mismatches always.
        """
        if strict:
            return super().load_state_dict(state_dict, strict=True, assign=assign)
        dropped = sorted(k for k in state_dict if k in _PRETRAINING_SECTIONS)
        kept = {k: v for k, v in state_dict.items() if k not in _PRETRAINING_SECTIONS}
        flat = flatten_checkpoint_state_dict(kept)
        own = self.state_dict()
        fresh = sorted(k for k in own if k not in flat)
        _check_pretrained_body(fresh, sorted(k for k in flat if k not in own), self.head_key)
        if dropped:
            log_rank_0(f" > loading a pretrained BERT: its {', '.join(dropped)} dropped")
        if fresh:
            log_rank_0(" > not in the checkpoint, initialized afresh: " + ", ".join(fresh))
        return super().load_state_dict(kept, strict=False, assign=assign)


def _check_pretrained_body(fresh: list[str], unused: list[str], head_key: str) -> None:
    """Megatron-LM loads a pretrained body strictly: a missing or extra encoder weight means
    another model shape (layers, a GPT...), which must not finetune half-initialized.

    Raises:
        ValueError: naming the body weights that are missing from, or left over in, the
            checkpoint.
    """
    missing = [k for k in fresh if not k.startswith((f"{head_key}.", *_OPTIONAL_BODY))]
    # Another task's head (a RACE model finetuned further on MNLI) is ignored, as Megatron's.
    extra = [k for k in unused
             if k.startswith("language_model.") and not k.startswith(_OPTIONAL_BODY)]
    if not (missing or extra):
        return
    problems = ([f"missing body weights: {', '.join(missing)}"] if missing else []) + \
        ([f"weights this model does not have: {', '.join(extra)}"] if extra else [])
    raise ValueError("the pretrained BERT does not fit the model (another --num-layers or model "
                     "type?): " + "; ".join(problems))


class Classification(BertWithHead):
    """Megatron-LM's ``Classification``: ``logits [b, k]`` from the pooled first position."""

    head_key = "classification_head"

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None, *,
                 num_classes: int, **kwargs) -> None:
        if num_classes < 2:
            raise ValueError(f"a classification head needs >= 2 classes, got {num_classes}")
        self.num_classes = num_classes
        super().__init__(config, tp_group, add_pooler=True, **kwargs)

    def build_head(self, config: TransformerConfig) -> None:
        self.classification_head = replicated_linear(config.hidden_size, self.num_classes,
                                                     config)

    def head(self, hidden: torch.Tensor, pooled: torch.Tensor | None) -> torch.Tensor:
        logits = self.classification_head(self.head_dropout(pooled))  # [b, k]
        return logits.view(-1, self.num_classes)


class MultipleChoice(BertWithHead):
    """Megatron-LM's ``MultipleChoice``: inputs ``[b, c, s]``, ``logits [b, c]``, one score
    per choice from its pooled first position."""

    head_key = "multichoice_head"

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None,
                 **kwargs) -> None:
        super().__init__(config, tp_group, add_pooler=True, **kwargs)

    def build_head(self, config: TransformerConfig) -> None:
        self.multichoice_head = replicated_linear(config.hidden_size, 1, config)

    def forward(self, input_ids: torch.Tensor | None, padding_mask: torch.Tensor,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``, ``padding_mask``, ``tokentype_ids``: ``[b, c, s]``; the choices run
        as ``b c`` sequences of the batch. Returns ``[b, c]`` on the last stage."""
        if padding_mask.dim() != 3:
            raise ValueError(f"MultipleChoice takes [batch, choices, seq] inputs; the padding "
                             f"mask has shape {tuple(padding_mask.shape)}")
        num_choices = padding_mask.size(1)

        def flat(t):
            return None if t is None else t.reshape(-1, t.size(-1))  # [b c, s]

        output = super().forward(flat(input_ids), flat(padding_mask), flat(tokentype_ids))
        if not self.post_process:
            return output  # [s, b c, h]
        return output.view(-1, num_choices)  # [b c, 1] -> [b, c]

    def head(self, hidden: torch.Tensor, pooled: torch.Tensor | None) -> torch.Tensor:
        """One score per sequence, ``[b c, 1]`` (:meth:`forward` groups them by question)."""
        return self.multichoice_head(self.head_dropout(pooled))  # [b c, 1]


class QuestionAnswering(BertWithHead):
    """BERT -> ``logits [b, s, 2]`` (start, end) from each position's final hidden state."""

    head_key = "qa_head"

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup | None,
                 **kwargs) -> None:
        super().__init__(config, tp_group, add_pooler=False, **kwargs)

    def build_head(self, config: TransformerConfig) -> None:
        self.qa_head = replicated_linear(config.hidden_size, 2, config)

    def head(self, hidden: torch.Tensor, pooled: torch.Tensor | None) -> torch.Tensor:
        logits = self.qa_head(hidden)  # [s, b, 2]
        return logits.transpose(0, 1).contiguous()  # [b, s, 2]
