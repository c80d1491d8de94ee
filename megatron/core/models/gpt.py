"""The GPT model (Megatron-LM's legacy ``GPTModel``): a :class:`LanguageModule` with a causal
mask whose head projects onto the tied word embeddings and takes the loss through the
vocabulary-parallel cross entropy.

Parameter names follow Megatron-LM's checkpoint keys (``language_model.embedding.*``,
``language_model.encoder.layers.N.*``...); :meth:`GPTModel.state_dict_for_save_checkpoint` gives
the nested layout of ``model_optim_rng.pt`` and :meth:`GPTModel.load_state_dict` reads it back.

Legend: b batch, s sequence, h hidden, V padded vocabulary, p TP size.
"""

from __future__ import annotations

import torch

from megatron.core.models.language_model import parallel_lm_logits
from megatron.core.models.language_module import LanguageModule

__all__ = ["GPTModel"]


class GPTModel(LanguageModule):
    """Causal language model split over TP ranks; pipeline stages via ``pre_process`` and
    ``post_process`` (see :class:`LanguageModule` for the arguments).

    ``forward(input_ids, position_ids, attention_mask=None, labels=None)``: ``input_ids`` and
    ``position_ids`` ``[b, s]`` (first stage); ``attention_mask`` bool ``[b|1, 1, s, s]``,
    True = masked, ``None`` = plain causal (the fast implicit path: callers whose mask is the
    plain causal one pass None, as Megatron-Core's, rather than have every forward compare it
    on the device); ``labels [b, s]`` or None. Returns, with ``labels``, the unreduced loss
    ``[b, s]`` (fp32 or wider; the training code reduces ``sum(loss * loss_mask) /
    sum(loss_mask)``); without, logits ``[b, s, V/p]`` (``[b, s, V]`` if not
    ``parallel_output``); on a non-last pipeline stage, hidden ``[s, b, h]``.
    """

    checkpoint_name = "GPT"
    attn_mask_type = "causal"

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                tokentype_ids: torch.Tensor | None = None, inference_params=None):
        """Run this stage: the language model, then (last stage) the logits and the loss.

        Args:
            input_ids: ``[b, s]`` token ids (first stage).
            position_ids: ``[b, s]``.
            attention_mask: bool ``[b|1, 1, s, s]``, True = masked; None = plain causal.
            labels: ``[b, s]`` target ids, or None.
            tokentype_ids: ``[b, s]`` segment ids (with ``num_tokentypes``).
            inference_params: the generation KV cache
                (:class:`~megatron.core.inference_params.InferenceParams`), or None.

        Returns:
            See the class docstring.
        """
        hidden = self.language_model(input_ids, position_ids, attention_mask,
                                     tokentype_ids, inference_params)  # [s, b, h]
        if not self.post_process:
            return hidden
        if getattr(inference_params, "materialize_only_last_token_logits", False):
            # Generation samples from the last position only: skip the others' vocab GEMM.
            hidden = hidden[-1:]  # [1, b, h]
        return self._logits_or_loss(hidden, labels)

    def _logits_or_loss(self, hidden: torch.Tensor, labels: torch.Tensor | None
                        ) -> torch.Tensor:
        """Logits on the (tied) output weight, then the loss if ``labels`` are given."""
        logits = parallel_lm_logits(hidden, self.output_weight(), self.tp_group,
                                    self.parallel_output or labels is not None,
                                    sequence_parallel=self.config.sequence_parallel,
                                    gradient_accumulation_fusion=(
                                        self.config.gradient_accumulation_fusion),
                                    )  # [s, b, V/p]: with SP the s/p rows are gathered
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, V/p]
        # The logits are a temporary nobody else reads: the loss overwrites them in place.
        loss = self.cross_entropy(logits, labels.transpose(0, 1))  # [s, b]
        return loss.transpose(0, 1).contiguous()  # [b, s]
