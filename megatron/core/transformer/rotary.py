"""Rotary position embeddings (RoPE, Su et al. 2021) as Megatron-LM applies them.

The angles are computed in fp32 (``inv_freq`` and the position products: bf16 positions would
round above 256), and their cosines and sines are cached with them per table length. The
language model takes the cosines and sines of the positions in the sequence (offset by the KV
cache while decoding) once per forward, in the activations' dtype, and every attention layer
rotates its queries and keys with that one pair. Only the first ``rotary_percent`` of each
head's dimensions rotate; the rest pass through.

Layouts of the rotated dimensions (``rot`` of them), as Megatron-LM's ``_rotate_half``:

* default: the two halves pair up, ``(x[i], x[i + rot/2])`` turns by angle ``theta_i``;
* ``rotary_interleaved``: adjacent dimensions pair up, ``(x[2i], x[2i + 1])`` turns by
  ``theta_i``.

Legend: s sequence, b batch, np heads, hn head size, rot rotated dimensions.
"""

from __future__ import annotations

from typing import Union

import torch

from megatron.core import device as device_mod


class RotaryEmbedding(torch.nn.Module):
    """The RoPE angle table (no parameters).

    Args:
        kv_channels: head size.
        rotary_percent: fraction of the head size that rotates, in (0, 1].
        rotary_interleaved: pair adjacent dimensions instead of the two halves.
        rotary_base: the base of the geometric frequency sequence.
    """

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0,
                 rotary_interleaved: bool = False, rotary_base: int = 10000) -> None:
        super().__init__()
        dim = int(kv_channels * rotary_percent)
        if dim < 2:
            raise ValueError(f"rotary_percent ({rotary_percent}) of kv_channels ({kv_channels}) "
                             "rotates fewer than 2 dimensions")
        self.dim, self.base, self.interleaved = dim, rotary_base, rotary_interleaved
        self._cache: tuple[int, torch.device, tuple[torch.Tensor, ...]] | None = None

    def table(self, length: int, device: torch.device) -> torch.Tensor:
        """fp32 angles ``[length, rot]`` of positions ``0 .. length-1`` (cached per length)."""
        return self._tables(length, device)[0]

    def _tables(self, length: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 ``(angles, cos, sin)``, each ``[length, rot]`` (computed once per length)."""
        if self._cache is not None and self._cache[0] >= length and self._cache[1] == device:
            return tuple(t[:length] for t in self._cache[2])
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        inv_freq = 1.0 / (self.base ** exponents)  # [rot/2]
        positions = torch.arange(length, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # [length, rot/2]
        if self.interleaved:
            # theta_i for dims 2i and 2i+1: [t0, t0, t1, t1, ...]
            angles = torch.stack((freqs, freqs), dim=-1).flatten(-2)  # [length, rot]
        else:
            angles = torch.cat((freqs, freqs), dim=-1)  # [length, rot]
        tables = (angles, torch.cos(angles), torch.sin(angles))
        self._cache = (length, device, tables)
        return tables

    def forward(self, seq_length: int, offset: int = 0, min_length: int = 0,
                device: torch.device | None = None, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[s, 1, 1, rot]`` in ``dtype``, of the angles of positions
        ``offset .. offset + seq_length - 1``: the position in the sequence (plus the KV
        cache's offset while decoding), never the batch's position ids, as Megatron-LM's GPT
        model (so ``--reset-position-ids`` does not restart the angles per document there
        either). They are taken in fp32 and cast, as Megatron-LM's
        ``_apply_rotary_pos_emb_bshd`` casts them. The table covers ``min_length`` positions
        (the model's maximum, so one table serves every step)."""
        _, cos, sin = self._tables(max(min_length, offset + seq_length),
                                   device or device_mod.get_device())
        rows = slice(offset, offset + seq_length)
        return (cos[rows].view(seq_length, 1, 1, self.dim).to(dtype),
                sin[rows].view(seq_length, 1, 1, self.dim).to(dtype))


RotaryPosEmb = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def rotary_cos_sin(rotary: RotaryPosEmb, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` in ``dtype`` from either form a layer accepts: fp32 angles
    ``[s, b|1, 1, rot]`` (cos and sin taken in fp32, then cast) or a ``(cos, sin)`` pair."""
    if isinstance(rotary, torch.Tensor):
        return torch.cos(rotary).to(dtype), torch.sin(rotary).to(dtype)
    cos, sin = rotary
    return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(t: torch.Tensor, rotary: RotaryPosEmb,
                         interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``rot`` dimensions of ``t`` ``[s, b, np, hn]`` by ``rotary``: a
    ``(cos, sin)`` pair ``[s, b|1, 1, rot]`` (see :meth:`RotaryEmbedding.forward`) or fp32
    angles of that shape (Megatron-LM's ``_apply_rotary_pos_emb_bshd``)."""
    cos, sin = rotary_cos_sin(rotary, t.dtype)
    rot = cos.size(-1)
    if rot == t.size(-1):  # --rotary-percent 1: nothing passes through, nothing to join
        return t * cos + _rotate_half(t, interleaved) * sin
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    t_rot = t_rot * cos + _rotate_half(t_rot, interleaved) * sin
    return torch.cat((t_rot, t_pass), dim=-1)
