"""The key/value cache of autoregressive generation (Megatron-LM's ``InferenceParams``).

Generation first runs the prompt through the model once (prefill), then feeds one new token per
step: each attention layer keeps the keys and values of the positions already seen, so a step
costs one position's work instead of the whole sequence's. The cache is preallocated per layer
for the batch's maximum length (``[max_sequence_length, max_batch_size, np, hn]``, this TP
rank's heads only), so no step reallocates.

Legend: s sequence, b batch, np heads on this rank, hn head size.
"""

from __future__ import annotations

import torch


class InferenceParams:
    """Per-generation cache state passed down the model in ``forward(..., inference_params=)``.

    Args:
        max_batch_size: rows of the batch (beam search: the beam width).
        max_sequence_length: longest sequence the cache must hold (prompt + generated).
        materialize_only_last_token_logits: the last pipeline stage projects only the last
            position of each forward onto the vocabulary (Megatron-Core's flag of the same
            name): sampling reads nothing else, and the prefill's ``[s, b, V]`` logits are
            most of its cost. False when the log-probs of every position are wanted.

    Attributes:
        sequence_len_offset: positions already in the cache; the caller advances it after each
            forward (the model does not: every layer of one forward writes the same positions).
        key_value_memory_dict: layer number -> (keys, values) ``[s_max, b_max, np, hn]``.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int, *,
                 materialize_only_last_token_logits: bool = False) -> None:
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(f"InferenceParams({max_batch_size}, {max_sequence_length}): the "
                             "batch size and the sequence length must be >= 1")
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.materialize_only_last_token_logits = materialize_only_last_token_logits
        self.key_value_memory_dict: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cache_for(self, layer_number: int, like: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (keys, values) buffers of ``layer_number``, allocated on first use with the
        dtype, device and head shape of ``like`` (``[s, b, np, hn]``)."""
        if layer_number not in self.key_value_memory_dict:
            shape = (self.max_sequence_length, self.max_batch_size) + tuple(like.shape[2:])
            self.key_value_memory_dict[layer_number] = (
                torch.empty(shape, dtype=like.dtype, device=like.device),
                torch.empty(shape, dtype=like.dtype, device=like.device))
        return self.key_value_memory_dict[layer_number]

    def store(self, layer_number: int, key: torch.Tensor, value: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's ``key``/``value`` ``[s, b, np, hn]`` at ``sequence_len_offset``
        and return every cached position so far (``[offset + s, b, np, hn]`` each).

        Raises:
            ValueError: the step would outgrow the preallocated length or batch.
        """
        s, b = key.shape[:2]
        start, end = self.sequence_len_offset, self.sequence_len_offset + s
        if end > self.max_sequence_length or b > self.max_batch_size:
            raise ValueError(f"KV cache holds {self.max_sequence_length} positions x "
                             f"{self.max_batch_size} rows; this step needs {end} x {b}")
        keys, values = self.cache_for(layer_number, key)
        keys[start:end, :b] = key
        values[start:end, :b] = value
        return keys[:end, :b], values[:end, :b]

    def swap_key_value_dict(self, batch_index: torch.Tensor) -> None:
        """Reorder every layer's cached rows by ``batch_index`` ``[b]`` (beam search keeps the
        beams it extends, in their new order)."""
        for layer_number, (keys, values) in self.key_value_memory_dict.items():
            b = batch_index.numel()
            index = batch_index.to(keys.device)
            self.key_value_memory_dict[layer_number] = (
                torch.cat([keys[:, index], keys[:, b:]], dim=1),
                torch.cat([values[:, index], values[:, b:]], dim=1))
