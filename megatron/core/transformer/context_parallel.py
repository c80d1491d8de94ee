"""Context parallelism: every sequence split over the ranks of a CP group, attention across them.

The sequence is cut into ``2 CP`` chunks and CP rank ``r`` holds chunks ``r`` and
``2 CP - r - 1`` (Megatron-Core's ``get_batch_on_this_cp_rank``): under a causal mask the early
chunks see few keys and the late ones many, so pairing them gives every rank the same work.
Everything outside attention is per token and runs on the local ``s / CP`` rows unchanged; the
RoPE angles and position ids are those of the global positions (:func:`split_for_cp`).

Attention reaches the other ranks' keys and values in one of three ways (``--cp-comm-type``):

* ``p2p``: a ring. Each of CP steps computes the local queries against one rank's key/value
  block while the next block travels; the partial outputs are merged with their log-sum-exp in
  fp32. Causal load balancing: the diagonal block (the rank's own) is masked, a block from an
  earlier rank is seen whole by both local chunks through its first chunk only, and a block from
  a later rank only by the local second chunk (the blocks above the diagonal are skipped).
  The backward runs the ring again; each block's key/value gradients travel with it and come
  home after the last step. An explicit ``autograd.Function``: nothing of the ring is recorded.
* ``all_gather``: keys and values are gathered once (Llama 3's training), each local chunk
  attends to the global prefix it sees; the key/value gradients are reduce-scattered back.
* ``a2a``: DeepSpeed-Ulysses: all-to-all from sequence-split to head-split, ordinary attention
  over the whole sequence on ``heads / CP`` heads, all-to-all back.

With grouped-query attention only the G key/value heads travel. The blocks run on a math path
(fp32 scores and log-sum-exp, fp64 kept for fp64 inputs) on every device, its query rows in
chunks of bounded size (:data:`MATH_BLOCK_BYTES`) so that no ``s x s`` block exists whole; on
CUDA in fp16/bf16 the flash kernel of ``scaled_dot_product_attention`` (which returns the
log-sum-exp) does.

Legend: s local sequence (``S / CP``), S global sequence, b batch, np query heads, g key/value
heads, r = np / g query heads per group, hn head size, c = s / 2 (one chunk).
"""

from __future__ import annotations

import math

import torch

from megatron.core import comm
from megatron.core.comm import ProcessGroup
from megatron.core.eager_regions import eager_region

CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


# Data split -----------------------------------------------------------------------------------
def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of the ``2 CP`` chunks rank ``cp_rank`` holds, in sequence order."""
    return cp_rank, 2 * cp_size - cp_rank - 1


def split_for_cp(t: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's two chunks of ``t`` along ``dim`` (of length S, divisible by 2 CP),
    concatenated: length S / CP."""
    if cp_size == 1:
        return t
    length = t.size(dim)
    if length % (2 * cp_size):
        raise ValueError(f"sequence length {length} is not divisible by 2 x context-parallel "
                         f"size ({2 * cp_size})")
    shape = t.shape
    # [.., S, ..] -> [.., 2 CP, S / 2 CP, ..]: pick the two chunks, fold them back.
    chunked = t.reshape(*shape[:dim], 2 * cp_size, length // (2 * cp_size), *shape[dim + 1:])
    index = torch.tensor(cp_chunk_ids(cp_size, cp_rank), device=t.device)
    picked = chunked.index_select(dim, index)
    return picked.reshape(*shape[:dim], length // cp_size, *shape[dim + 1:])


def merge_cp_pieces(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of :func:`split_for_cp`: every rank's piece (in CP-rank order) -> the whole."""
    cp = len(pieces)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, piece in enumerate(pieces):
        first, second = piece.chunk(2, dim=dim)
        a, b = cp_chunk_ids(cp, rank)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)


def get_batch_on_this_cp_rank(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """Megatron-Core's split of a micro-batch: ``[b, S]`` tensors (tokens, labels, loss mask,
    position ids) along dim 1. The attention mask must be the plain causal one (or None): the
    attention applies it over global positions itself, so it is dropped.

    Raises:
        ValueError: another mask (packed documents), which the attention cannot apply.
    """
    if cp_size == 1:
        return batch
    out = {}
    for key, value in batch.items():
        if key == "attention_mask":
            if value is not None and not _is_plain_causal(value):
                raise ValueError("context parallelism applies the causal mask itself: a "
                                 "per-document mask (--reset-attention-mask) is not supported")
            out[key] = None
        else:
            out[key] = None if value is None else split_for_cp(value, 1, cp_size, cp_rank)
    return out


def _is_plain_causal(mask: torch.Tensor) -> bool:
    """``[b|1, 1, S, S]`` bool, True exactly above the diagonal."""
    s = mask.size(-1)
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).triu(1)
    return mask.size(-2) == s and bool((mask == causal).all())


# Block attention ------------------------------------------------------------------------------
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


FLASH_ON_CPU = False
"""Run the blocks on torch's CPU flash kernel instead of the math path (tests of the kernel
plumbing; the math path is the CPU default)."""


def _use_flash(q: torch.Tensor) -> bool:
    """The flash kernel (it returns the log-sum-exp): on CUDA in half precision with a head
    size it takes."""
    if q.device.type == "cpu":
        return FLASH_ON_CPU
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and q.size(-1) % 8 == 0 and q.size(-1) <= 256)


MATH_BLOCK_BYTES = 4 * 2**20
"""Bound on the math path's transient score tensors in host memory: a block's query rows are
processed in chunks whose ``[b, g, r, rows, sk]`` scores take at most this many bytes (at least
one row), so the scores, probabilities and their gradients never cover a whole ``s x s`` block.
Softmax is per query row, so the chunks give the unchunked numbers (key/value gradients summed
over the chunks). Small chunks cost nothing on a CPU (they stay in cache)."""

MATH_BLOCK_BYTES_ACCELERATOR = 256 * 2**20
"""The same bound on a GPU (fp32 blocks there), larger: every chunk is a kernel launch."""


def _row_chunk(q: torch.Tensor, sk: int, acc: torch.dtype, q_chunk: int | None) -> int:
    """Query rows per chunk: ``q_chunk`` if given, else what the byte bound allows."""
    if q_chunk is not None:
        return max(1, q_chunk)
    budget = MATH_BLOCK_BYTES if q.device.type == "cpu" else MATH_BLOCK_BYTES_ACCELERATOR
    b, g, r = q.shape[:3]
    per_row = b * g * r * sk * (torch.finfo(acc).bits // 8)
    return max(1, budget // max(1, per_row))


def _row_chunks(sq: int, sk: int, rows: int, causal: bool):
    """(query rows, key count) of each chunk; on the diagonal a chunk ending at row ``stop``
    sees only the first ``stop`` keys (the rest are masked for all its rows)."""
    for start in range(0, sq, rows):
        stop = min(start + rows, sq)
        yield slice(start, stop), (stop if causal else sk)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool, q_chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: q ``[b, g, r, sq, hn]``, k, v ``[b, g, sk, hn]`` -> (out ``[b, g, r, sq, hn]``
    in the accumulation dtype, log-sum-exp ``[b, g, r, sq]`` fp32 or fp64). ``causal``: the
    diagonal block, query i sees keys ``<= i`` (sq == sk). ``q_chunk``: query rows per chunk of
    the math path (default from :data:`MATH_BLOCK_BYTES`)."""
    if _use_flash(q):
        return _flash_forward(q, k, v, scale, causal)
    acc = _acc_dtype(q.dtype)
    sq, sk = q.size(3), k.size(2)
    rows = _row_chunk(q, sk, acc, q_chunk)
    if rows >= sq:
        return _math_forward(q, k, v, scale, 0 if causal else None, acc)
    out = torch.empty(*q.shape[:-1], v.size(-1), dtype=acc, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=acc, device=q.device)
    for qrows, keys in _row_chunks(sq, sk, rows, causal):
        out[:, :, :, qrows], lse[..., qrows] = _math_forward(
            q[:, :, :, qrows], k[:, :, :keys], v[:, :, :keys], scale,
            qrows.start if causal else None, acc)
    return out, lse


def _math_forward(q, k, v, scale: float, diag: int | None, acc: torch.dtype):
    """Softmax attention of q ``[b, g, r, rows, hn]`` over k, v ``[b, g, keys, hn]``; ``diag``:
    the global row of q's first row in a diagonal block (key j masked for row i when j > i)."""
    scores = torch.einsum("bgrqd,bgkd->bgrqk", q.to(acc), k.to(acc)).mul_(scale)
    if diag is not None:
        scores.masked_fill_(_above_diagonal(scores, diag), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [b, g, r, rows]
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()  # in place: one rows x keys tensor
    return torch.einsum("bgrqk,bgkd->bgrqd", probs, v.to(acc)), lse


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   dout: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
                   q_chunk: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the merged (final) ``out`` and ``lse`` of its queries:
    (dq ``[b, g, r, sq, hn]``, dk, dv ``[b, g, sk, hn]``) in the accumulation dtype; the math
    path in chunks of ``q_chunk`` query rows as :func:`block_forward`."""
    if _use_flash(q):
        return _flash_backward(q, k, v, out, dout, lse, scale, causal)
    acc = _acc_dtype(q.dtype)
    sq, sk = q.size(3), k.size(2)
    rows = _row_chunk(q, sk, acc, q_chunk)
    if rows >= sq:
        return _math_backward(q, k, v, out, dout, lse, scale, 0 if causal else None, acc)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for qrows, keys in _row_chunks(sq, sk, rows, causal):
        dq[:, :, :, qrows], bk, bv = _math_backward(
            q[:, :, :, qrows], k[:, :, :keys], v[:, :, :keys], out[:, :, :, qrows],
            dout[:, :, :, qrows], lse[..., qrows], scale, qrows.start if causal else None, acc)
        dk[:, :, :keys] += bk
        dv[:, :, :keys] += bv
    return dq, dk, dv


def _math_backward(q, k, v, out, dout, lse, scale: float, diag: int | None, acc: torch.dtype):
    """dq, dk, dv of :func:`_math_forward`'s rows given the merged out and lse."""
    q, k, v, dout = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    scores = torch.einsum("bgrqd,bgkd->bgrqk", q, k).mul_(scale)
    if diag is not None:
        scores.masked_fill_(_above_diagonal(scores, diag), float("-inf"))
    probs = scores.sub_(lse.to(acc).unsqueeze(-1)).exp_()  # [b, g, r, rows, keys]
    delta = (dout * out.to(acc)).sum(-1, keepdim=True)  # [b, g, r, rows, 1]
    dv = torch.einsum("bgrqk,bgrqd->bgkd", probs, dout)
    # dscores = probs * (dprobs - delta) * scale, in dprobs' storage.
    dscores = torch.einsum("bgrqd,bgkd->bgrqk", dout, v).sub_(delta).mul_(probs).mul_(scale)
    del probs, scores
    dq = torch.einsum("bgrqk,bgkd->bgrqd", dscores, k)
    dk = torch.einsum("bgrqk,bgrqd->bgkd", dscores, q)
    return dq, dk, dv


def _above_diagonal(scores: torch.Tensor, diag: int = 0) -> torch.Tensor:
    """True where key j > query row ``diag + i`` (the rows of a chunk starting at ``diag``)."""
    sq, sk = scores.shape[-2:]
    return torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1 + diag)


def _heads(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, g, r, sq, hn]``, ``[b, g, sk, hn]`` -> the kernel's ``[b, np, sq, hn]`` and
    ``[b, np, sk, hn]`` (keys repeated per query head after they travelled)."""
    b, g, r, sq, hn = q.shape
    return q.reshape(b, g * r, sq, hn), k.unsqueeze(2).expand(b, g, r, *k.shape[2:]).reshape(
        b, g * r, k.size(2), hn)


def _flash_forward(q, k, v, scale, causal):
    b, g, r, sq, hn = q.shape
    qh, kh = _heads(q, k)
    _, vh = _heads(q, v)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh, kh, vh, 0.0, causal, scale=scale)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            qh, kh, vh, 0.0, causal, False, scale=scale)[:2]
    acc = _acc_dtype(q.dtype)
    return out.to(acc).reshape(b, g, r, sq, hn), lse.to(acc).reshape(b, g, r, sq)


def _flash_backward(q, k, v, out, dout, lse, scale, causal):
    b, g, r, sq, hn = q.shape
    sk = k.size(2)
    qh, kh = _heads(q, k)
    _, vh = _heads(q, v)
    oh = out.to(q.dtype).reshape(b, g * r, sq, hn)
    doh = dout.to(q.dtype).reshape(b, g * r, sq, hn)
    lse = lse.float().reshape(b, g * r, sq).contiguous()
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            doh, qh, kh, vh, oh, lse.to(q.dtype) if q.dtype == torch.float64 else lse, 0.0,
            causal, scale=scale)
    else:
        empty = torch.empty(0, device=q.device, dtype=torch.int64)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            doh, qh, kh, vh, oh, lse, empty, empty, sq, sk, 0.0, causal, empty, empty,
            scale=scale)
    acc = _acc_dtype(q.dtype)
    # Each group's key/value gradient is the sum over its query heads.
    return (dq.to(acc).reshape(b, g, r, sq, hn), dk.to(acc).reshape(b, g, r, sk, hn).sum(2),
            dv.to(acc).reshape(b, g, r, sk, hn).sum(2))


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                  block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the union of two key sets from each set's normalized output and
    log-sum-exp: weights ``exp(lse_i - lse)`` with ``lse = logaddexp(lse_1, lse_2)``."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) \
        + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return out, new_lse


# p2p: the ring --------------------------------------------------------------------------------
def _ring_peers(cp_group: ProcessGroup) -> tuple[int, int]:
    """Global ranks of the next and the previous CP rank."""
    cp, rank = comm.world_size(cp_group), comm.rank(cp_group)
    return (comm.global_rank(cp_group, (rank + 1) % cp),
            comm.global_rank(cp_group, (rank - 1) % cp))


def _exchange(send: torch.Tensor, cp_group: ProcessGroup) -> tuple[torch.Tensor, list]:
    """Post: ``send`` to the next rank, a tensor of its shape from the previous one."""
    nxt, prev = _ring_peers(cp_group)
    recv = torch.empty_like(send)
    return recv, comm.batch_isend_irecv([("send", send, nxt), ("recv", recv, prev)], cp_group)


def _ring_blocks(step: int, cp_rank: int, cp: int, causal: bool, s: int):
    """The block of step ``step`` (key/value block of rank ``cp_rank - step``): (query rows,
    key rows, masked diagonal), or None where the block is above the diagonal (none here:
    causal load balancing keeps half of every block)."""
    whole = slice(0, s)
    if not causal:
        return whole, whole, False
    src = (cp_rank - step) % cp
    if step == 0:
        return whole, whole, True
    if src < cp_rank:  # an earlier rank: its first chunk precedes both local chunks
        return whole, slice(0, s // 2), False
    return slice(s // 2, s), whole, False  # a later rank: only the local second chunk sees it


class RingAttention(torch.autograd.Function):
    """p2p context-parallel attention on ``[b, g, r, s, hn]`` queries and ``[b, g, s, hn]``
    keys and values; returns ``[b, g, r, s, hn]`` in the input dtype."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, cp_group: ProcessGroup):
        cp, cp_rank = comm.world_size(cp_group), comm.rank(cp_group)
        s = q.size(3)
        kv = torch.stack((k, v))  # [2, b, g, s, hn]: one message per step
        out = lse = None
        for step in range(cp):
            pending = _exchange(kv, cp_group) if step < cp - 1 else None
            rows, cols, diag = _ring_blocks(step, cp_rank, cp, causal, s)
            block_out, block_lse = block_forward(q[:, :, :, rows], kv[0][:, :, cols],
                                                 kv[1][:, :, cols], scale, diag)
            if out is None:  # step 0 covers every query row
                out, lse = block_out, block_lse
            else:
                # In place: autograd records nothing inside a Function's forward.
                out[:, :, :, rows], lse[..., rows] = merge_partial(
                    out[:, :, :, rows], lse[..., rows], block_out, block_lse)
            if pending is not None:
                comm.wait(pending[1], "context-parallel ring exchange", cp_group)
                kv = pending[0]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.cp_group = causal, scale, cp_group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp_group, causal, scale = ctx.cp_group, ctx.causal, ctx.scale
        cp, cp_rank = comm.world_size(cp_group), comm.rank(cp_group)
        s = q.size(3)
        kv = torch.stack((k, v))
        dq = torch.zeros_like(out)
        dkv = torch.zeros(kv.shape, dtype=out.dtype, device=kv.device)  # travels with kv
        for step in range(cp):
            pending = _exchange(kv, cp_group) if step < cp - 1 else None
            rows, cols, diag = _ring_blocks(step, cp_rank, cp, causal, s)
            bq, bk, bv = block_backward(q[:, :, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                        out[:, :, :, rows], dout[:, :, :, rows], lse[..., rows],
                                        scale, diag)
            dq[:, :, :, rows] += bq
            dkv[0][:, :, cols] += bk
            dkv[1][:, :, cols] += bv
            # The block's gradient moves on with the block; after the last step it goes home.
            dkv_recv, dkv_pending = _exchange(dkv, cp_group)
            comm.wait(dkv_pending, "context-parallel ring exchange", cp_group)
            dkv = dkv_recv
            if pending is not None:
                comm.wait(pending[1], "context-parallel ring exchange", cp_group)
                kv = pending[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


# all_gather -----------------------------------------------------------------------------------
def _gather_sequence(t: torch.Tensor, cp_group: ProcessGroup, dim: int) -> torch.Tensor:
    """Every rank's piece of ``t`` (local sequence along ``dim``) -> the global sequence."""
    pieces = comm.all_gather_list(t.contiguous(), cp_group)
    return merge_cp_pieces(pieces, dim)


def _chunk_views(cp: int, cp_rank: int, c: int):
    """(local query rows, number of global keys it sees) of each of the two local chunks."""
    return [(slice(i * c, (i + 1) * c), (chunk + 1) * c)
            for i, chunk in enumerate(cp_chunk_ids(cp, cp_rank))]


class AllGatherAttention(torch.autograd.Function):
    """all_gather context-parallel attention, same shapes as :class:`RingAttention`."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, cp_group: ProcessGroup):
        cp, cp_rank = comm.world_size(cp_group), comm.rank(cp_group)
        kv = _gather_sequence(torch.stack((k, v)), cp_group, dim=3)  # [2, b, g, S, hn]
        if not causal:
            out, lse = block_forward(q, kv[0], kv[1], scale, False)
        else:
            parts = [_prefix_forward(q[:, :, :, rows], kv, seen, scale)
                     for rows, seen in _chunk_views(cp, cp_rank, q.size(3) // 2)]
            out = torch.cat([p[0] for p in parts], dim=3)
            lse = torch.cat([p[1] for p in parts], dim=3)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.cp_group = causal, scale, cp_group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp_group, causal, scale = ctx.cp_group, ctx.causal, ctx.scale
        cp, cp_rank = comm.world_size(cp_group), comm.rank(cp_group)
        kv = _gather_sequence(torch.stack((k, v)), cp_group, dim=3)  # recomputed: not saved
        dkv = torch.zeros(kv.shape, dtype=out.dtype, device=kv.device)
        if not causal:
            dq, dkv[0], dkv[1] = block_backward(q, kv[0], kv[1], out, dout, lse, scale, False)
        else:
            dq = torch.zeros_like(out)
            for rows, seen in _chunk_views(cp, cp_rank, q.size(3) // 2):
                c = rows.stop - rows.start
                # Keys before the chunk: unmasked; the chunk's own keys: the diagonal.
                for cols, diag in ((slice(0, seen - c), False), (slice(seen - c, seen), True)):
                    if cols.stop == cols.start:
                        continue
                    bq, bk, bv = block_backward(
                        q[:, :, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                        out[:, :, :, rows], dout[:, :, :, rows], lse[..., rows], scale, diag)
                    dq[:, :, :, rows] += bq
                    dkv[0][:, :, cols] += bk
                    dkv[1][:, :, cols] += bv
        # Sum every rank's key/value gradient and hand each rank its own chunks.
        local = _reduce_scatter_sequence(dkv, cp_group, dim=3)
        return dq.to(q.dtype), local[0].to(k.dtype), local[1].to(v.dtype), None, None, None


def _prefix_forward(q, kv, seen: int, scale: float):
    """A local chunk of c queries against the ``seen`` global keys it sees (its own chunk
    last, masked at the diagonal): out and log-sum-exp."""
    c = q.size(3)
    out, lse = block_forward(q, kv[0][:, :, seen - c:seen], kv[1][:, :, seen - c:seen],
                             scale, True)
    if seen > c:
        before = block_forward(q, kv[0][:, :, :seen - c], kv[1][:, :, :seen - c], scale, False)
        out, lse = merge_partial(out, lse, *before)
    return out, lse


def _reduce_scatter_sequence(t: torch.Tensor, cp_group: ProcessGroup, dim: int) -> torch.Tensor:
    """Global-sequence ``t`` on every rank -> the sum over ranks of this rank's two chunks."""
    cp = comm.world_size(cp_group)
    pieces = [split_for_cp(t, dim, cp, rank).contiguous() for rank in range(cp)]
    stacked = torch.stack(pieces)  # [CP, ...]: rank i's rows first
    out = torch.empty_like(pieces[0])
    comm.reduce_scatter_into(out.view(-1), stacked.view(-1), cp_group)
    return out


# a2a: Ulysses ---------------------------------------------------------------------------------
class _SequenceToHeads(torch.autograd.Function):
    """``[s, b, n, hn]`` sequence-split -> ``[S, b, n / CP, hn]`` head-split (global sequence
    order); backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, t, cp_group: ProcessGroup):
        ctx.cp_group = cp_group
        return _seq_to_heads(t, cp_group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.cp_group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cp_group: ProcessGroup):
        ctx.cp_group = cp_group
        return _heads_to_seq(t, cp_group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.cp_group), None


def _seq_to_heads(t: torch.Tensor, cp_group: ProcessGroup) -> torch.Tensor:
    cp = comm.world_size(cp_group)
    s, b, n, hn = t.shape
    # [s, b, CP, n/CP, hn] -> [CP, s, b, n/CP, hn]: piece i (heads of rank i) goes to rank i.
    send = t.reshape(s, b, cp, n // cp, hn).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)  # [CP, s, b, n/CP, hn]: piece j = rank j's rows
    comm.all_to_all_single(recv, send, cp_group)
    return merge_cp_pieces(list(recv.unbind(0)), dim=0)  # [S, b, n/CP, hn]


def _heads_to_seq(t: torch.Tensor, cp_group: ProcessGroup) -> torch.Tensor:
    cp = comm.world_size(cp_group)
    send = torch.stack([split_for_cp(t, 0, cp, rank) for rank in range(cp)])  # [CP, s, b, n/CP, hn]
    recv = torch.empty_like(send)  # piece j: this rank's rows of rank j's heads
    comm.all_to_all_single(recv, send, cp_group)
    cp_, s, b, n, hn = recv.shape
    return recv.permute(1, 2, 0, 3, 4).reshape(s, b, cp_ * n, hn)  # [s, b, np, hn]


def _ulysses_attention(q, k, v, causal: bool, scale: float, cp_group: ProcessGroup):
    """q ``[s, b, np, hn]``, k, v ``[s, b, g, hn]`` -> ``[s, b, np, hn]``."""
    qh, kh, vh = (_SequenceToHeads.apply(t, cp_group) for t in (q, k, v))  # [S, b, n/CP, hn]
    S, b, nq, hn = qh.shape
    g = kh.size(2)
    q5 = qh.permute(1, 2, 0, 3).reshape(b, g, nq // g, S, hn)  # [b, g, r, S, hn]
    k4, v4 = kh.permute(1, 2, 0, 3), vh.permute(1, 2, 0, 3)  # [b, g, S, hn]
    out = _LocalAttention.apply(q5, k4, v4, causal, scale)  # [b, g, r, S, hn]
    out = out.reshape(b, nq, S, hn).permute(2, 0, 1, 3)  # [S, b, n/CP, hn]
    return _HeadsToSequence.apply(out, cp_group)


class _LocalAttention(torch.autograd.Function):
    """Whole-sequence attention on this rank's heads through the block kernels."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        out, lse = block_forward(q, k, v, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(q, k, v, out, dout, lse, ctx.scale, ctx.causal)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


# Entry point ----------------------------------------------------------------------------------
# Inside a compiled layer (--compile-layers) the attention core is a graph break: it runs
# eagerly, and the rest of the layer (projections, RoPE, MLP, norms) compiles around it, two
# graphs a layer. Tracing it is not an option for the ring: torch's functional collectives have
# no point-to-point send/recv, and the ring's overlap of an exchange with a block's compute is
# the reason it exists. The all_gather and a2a forms could be traced as functional
# collectives, but their explicit backward Functions (recomputed gathers, reduce-scatters) and
# comm's NCCL-rule checks would then go through AOTAutograd as opaque custom Functions; one
# eager region per layer keeps all three forms the same code, tested against the eager run.
@eager_region
def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               cp_group: ProcessGroup, comm_type: str = "p2p", causal: bool = True,
                               scale: float | None = None) -> torch.Tensor:
    """softmax(Q K^T scale) V over the global sequence, from this rank's rows.

    Args:
        query: ``[s, b, np, hn]`` this rank's two chunks of the sequence.
        key: ``[s, b, g, hn]`` (g divides np: grouped-query attention).
        value: ``[s, b, g, hn]``.
        cp_group: the context-parallel group.
        comm_type: ``p2p``, ``all_gather`` or ``a2a``.
        causal: causal mask over global positions; False: every key.
        scale: default ``1 / sqrt(hn)``.

    Returns:
        Context ``[s, b, np * hn]`` in the query's dtype.
    """
    s, b, np_, hn = query.shape
    g = key.size(2)
    scale = 1.0 / math.sqrt(hn) if scale is None else scale
    if comm_type == "a2a":
        out = _ulysses_attention(query, key, value, causal, scale, cp_group)  # [s, b, np, hn]
        return out.reshape(s, b, np_ * hn)
    q = query.permute(1, 2, 0, 3).reshape(b, g, np_ // g, s, hn)  # [b, g, r, s, hn]
    k, v = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)  # [b, g, s, hn]
    fn = {"p2p": RingAttention, "all_gather": AllGatherAttention}.get(comm_type)
    if fn is None:
        raise ValueError(f"cp_comm_type {comm_type!r}: use one of {', '.join(CP_COMM_TYPES)}")
    out = fn.apply(q.contiguous(), k.contiguous(), v.contiguous(), causal, scale, cp_group)
    return out.reshape(b, np_, s, hn).permute(2, 0, 1, 3).reshape(s, b, np_ * hn)
