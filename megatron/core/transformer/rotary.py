"""Rotary position embeddings (RoPE, Su et al. 2021) as Megatron-LM applies them.

The angles are computed in fp32 (``inv_freq`` and the position products: bf16 positions would
round above 256) and cached per table length; the language model takes the angles of the
positions in the sequence (offset by the KV cache while decoding) and every attention layer
rotates its queries and keys with them. Only the
first ``rotary_percent`` of each head's dimensions rotate; the rest pass through.

Layouts of the rotated dimensions (``rot`` of them), as Megatron-LM's ``_rotate_half``:

* default: the two halves pair up, ``(x[i], x[i + rot/2])`` turns by angle ``theta_i``;
* ``rotary_interleaved``: adjacent dimensions pair up, ``(x[2i], x[2i + 1])`` turns by
  ``theta_i``.

Legend: s sequence, b batch, np heads, hn head size, rot rotated dimensions.
"""

from __future__ import annotations

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
        self._cache: tuple[int, torch.device, torch.Tensor] | None = None

    def table(self, length: int, device: torch.device) -> torch.Tensor:
        """fp32 angles ``[length, rot]`` of positions ``0 .. length-1`` (cached per length)."""
        if self._cache is not None and self._cache[0] >= length and self._cache[1] == device:
            return self._cache[2][:length]
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        inv_freq = 1.0 / (self.base ** exponents)  # [rot/2]
        positions = torch.arange(length, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # [length, rot/2]
        if self.interleaved:
            # theta_i for dims 2i and 2i+1: [t0, t0, t1, t1, ...]
            angles = torch.stack((freqs, freqs), dim=-1).flatten(-2)  # [length, rot]
        else:
            angles = torch.cat((freqs, freqs), dim=-1)  # [length, rot]
        self._cache = (length, device, angles)
        return angles

    def forward(self, seq_length: int, offset: int = 0, min_length: int = 0,
                device: torch.device | None = None) -> torch.Tensor:
        """Angles ``[s, 1, 1, rot]`` of positions ``offset .. offset + seq_length - 1``: the
        position in the sequence (plus the KV cache's offset while decoding), never the batch's
        position ids, as Megatron-LM's GPT model (so ``--reset-position-ids`` does not restart
        the angles per document there either). The table covers ``min_length`` positions (the
        model's maximum, so one table serves every step)."""
        table = self.table(max(min_length, offset + seq_length),
                           device or device_mod.get_device())
        return table[offset:offset + seq_length].view(seq_length, 1, 1, self.dim)


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(t: torch.Tensor, angles: torch.Tensor,
                         interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``rot`` dimensions of ``t`` ``[s, b, np, hn]`` by ``angles``
    ``[s, b|1, 1, rot]``; cos and sin are taken in fp32 and cast to ``t``'s dtype, as
    Megatron-LM's ``_apply_rotary_pos_emb_bshd``."""
    rot = angles.size(-1)
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    cos = torch.cos(angles).to(t.dtype)
    sin = torch.sin(angles).to(t.dtype)
    t_rot = t_rot * cos + _rotate_half(t_rot, interleaved) * sin
    return torch.cat((t_rot, t_pass), dim=-1)
