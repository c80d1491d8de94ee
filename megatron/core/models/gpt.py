"""The GPT model: embedding, causal transformer, output layer tied to the word embeddings, and
the loss through the vocabulary-parallel cross entropy (Megatron-LM's legacy ``GPTModel``).

Parameter names follow Megatron-LM's checkpoint keys (``language_model.embedding.*``,
``language_model.encoder.layers.N.*``...); :meth:`GPTModel.state_dict_for_save_checkpoint` gives
the nested layout of ``model_optim_rng.pt`` and :meth:`GPTModel.load_state_dict` reads it back.

Legend: b batch, s sequence, h hidden, V padded vocabulary, p TP size.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron.core import parallel_state
from megatron.core.models.language_model import (TransformerLanguageModel, is_plain_causal_mask,
                                                 parallel_lm_logits)
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.utils import ProcessGroup, set_defaults_if_not_set
from megatron.core.transformer.config import TransformerConfig, transformer_config_from

# Older checkpoints' names -> current ones (Megatron-LM renamed both in 2021).
_LEGACY_RENAMES = (("language_model.transformer.", "language_model.encoder."),
                   (".attention.", ".self_attention."))


class GPTModel(torch.nn.Module):
    """Causal language model split over TP ranks; pipeline stages via the flags below.

    Args:
        config: transformer + language-model settings (``padded_vocab_size`` required).
        group: the TP process group (``None`` = no tensor parallelism).
        pre_process: first pipeline stage (holds the embedding).
        post_process: last pipeline stage (final LayerNorm, logits, loss).
        parallel_output: return vocab-split logits ``[b, s, V/p]`` (else gathered ``[b, s, V]``).
        num_layers: layers on this stage (default all).
        layer_offset: global index of this stage's first layer.
    """

    def __init__(self, config: TransformerConfig, group: ProcessGroup | None, *,
                 pre_process: bool = True, post_process: bool = True,
                 parallel_output: bool = True, num_layers: int | None = None,
                 layer_offset: int = 0) -> None:
        super().__init__()
        self.config, self.group = config, group
        self.pre_process, self.post_process = pre_process, post_process
        self.parallel_output = parallel_output
        self.untie = config.untie_embeddings_and_output_weights
        # Read by finalize_model_grads (embedding-group all-reduce with PP > 1).
        self.share_embeddings_and_output_weights = not self.untie
        self.language_model = TransformerLanguageModel(
            config, group, pre_process=pre_process, post_process=post_process,
            num_layers=num_layers, layer_offset=layer_offset, attn_mask_type="causal")
        self.word_embeddings = None
        if post_process and not pre_process and not self.untie:
            # Last pipeline stage without the embedding: its own copy of the tied weight,
            # zero here; the pipeline code copies stage 0's weight in over the embedding group
            # and all-reduces the two gradients (Megatron's word_embeddings_for_head).
            self.word_embeddings = tp_layers.VocabParallelEmbedding(
                config.padded_vocab_size, config.hidden_size, group=group,
                init_method=torch.nn.init.zeros_, params_dtype=config.params_dtype)
            # A duplicate of stage 0's weight: grad-norm code skips `shared` params. With one
            # stage the logits use the embedding Parameter itself, which is not a duplicate and
            # so is not marked (marking it would drop it from the grad norm).
            self.word_embeddings.weight.shared = True
            self.word_embeddings.weight.shared_embedding = True
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

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """Activation from the previous pipeline stage (``[s, b, h]``)."""
        self.language_model.set_input_tensor(input_tensor)

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                ) -> torch.Tensor:
        """Run this stage.

        Args:
            input_ids: ``[b, s]`` token ids (first stage).
            position_ids: ``[b, s]``.
            attention_mask: bool ``[b|1, 1, s, s]``, True = masked; ``None`` = plain causal.
                A plain causal mask is detected and replaced by the fast causal path.
            labels: ``[b, s]`` target ids, or None.

        Returns:
            With ``labels``: the unreduced loss ``[b, s]`` (fp32 or wider); the training code
            reduces ``sum(loss * loss_mask) / sum(loss_mask)``. Without: logits
            ``[b, s, V/p]`` (``[b, s, V]`` if not ``parallel_output``). On a non-last pipeline
            stage: hidden ``[s, b, h]``.
        """
        if attention_mask is not None and is_plain_causal_mask(attention_mask):
            attention_mask = None
        hidden = self.language_model(input_ids, position_ids, attention_mask)  # [s, b, h]
        if not self.post_process:
            return hidden
        weight = (self.language_model.output_layer.weight if self.untie
                  else self.shared_embedding_or_output_weight())
        logits = parallel_lm_logits(hidden, weight, self.group,
                                    self.parallel_output or labels is not None)  # [s, b, V/p]
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, V/p]
        if logits.dtype in (torch.float16, torch.bfloat16) and not \
                self.config.fp16_lm_cross_entropy:
            logits = logits.float()  # the loss in fp32 (float64 stays float64)
        # The logits are a temporary nobody else reads (the output layer's backward needs only
        # hidden and weight): the loss may overwrite them in place.
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.group,
                                            inplace=True)  # [s, b]
        return loss.transpose(0, 1).contiguous()  # [b, s]

    # Checkpoint layout ---------------------------------------------------------------------
    def state_dict_for_save_checkpoint(self) -> dict:
        """Megatron-LM's legacy nested model dict (``sd['model']`` of ``model_optim_rng.pt``)."""
        out = {"language_model": self.language_model.state_dict_for_save_checkpoint()}
        if self.word_embeddings is not None:
            out["word_embeddings_for_head"] = self.word_embeddings.state_dict()
        return out

    def load_state_dict(self, state_dict: Mapping, strict: bool = True, assign: bool = False):
        """Load the nested checkpoint layout (also old ``transformer``/``.attention.`` names) or
        this module's flat ``state_dict()``.

        Raises:
            ValueError: with ``strict``, missing or unexpected keys or shape mismatches, all
                listed (and, without ``strict``, shape mismatches).
        """
        flat = flatten_checkpoint_state_dict(state_dict)
        own = self.state_dict()
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
        if problems:
            raise ValueError("GPT checkpoint does not fit the model:\n  " + "\n  ".join(problems))
        flat = {k: v for k, v in flat.items() if k in own}
        return super().load_state_dict(flat, strict=strict, assign=assign)


def flatten_checkpoint_state_dict(state_dict: Mapping) -> dict[str, torch.Tensor]:
    """Megatron-LM's nested model dict -> flat module names; flat dicts pass through. Old names
    (``transformer`` for ``encoder``, ``.attention.`` for ``.self_attention.``) are mapped."""
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(f"{prefix}{key}.", value)
        else:
            flat[prefix[:-1]] = node

    walk("", state_dict)
    out = {}
    for key, value in flat.items():
        for old, new in _LEGACY_RENAMES:
            key = key.replace(old, new)
        if key.startswith("word_embeddings_for_head."):
            key = "word_embeddings." + key[len("word_embeddings_for_head."):]
        out[key] = value
    return out


def gpt_model_from(cfg, pre_process: bool | None = None, post_process: bool | None = None,
                   ) -> GPTModel:
    """Build this rank's GPT stage from a validated ``MegatronConfig`` (reads parallel_state).

    Seed first, identically on all TP ranks (Megatron: ``torch.manual_seed(seed + 100 * pp_rank)``
    and :func:`~megatron.core.tensor_parallel.model_parallel_manual_seed`): the weights are drawn
    from torch's default generator.
    """
    config = transformer_config_from(cfg)
    group = None
    if parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    per_stage = config.num_layers // pp
    if pre_process is None:
        pre_process = pp_rank == 0
    if post_process is None:
        post_process = pp_rank == pp - 1
    return GPTModel(config, group, pre_process=pre_process, post_process=post_process,
                    num_layers=per_stage, layer_offset=pp_rank * per_stage)
