"""Context-parallel attention equals full attention (forward and dq/dk/dv, float64) at CP=2 and
CP=4, causal and not, MHA and GQA, every --cp-comm-type; the 2 CP chunk split round-trips."""

from __future__ import annotations

import pytest
import torch

from megatron.core.transformer import context_parallel as cpa
from tests.multiprocess import run_distributed

SEQ, BATCH, HEADS, HEAD_DIM = 16, 2, 8, 8
TOL = 1e-10


def _reference(q, k, v, causal: bool):
    """Plain attention over the whole sequence, q [S, b, np, hn], k, v [S, b, g, hn]."""
    rep = q.size(2) // k.size(2)
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbnd,kbnd->bnqk", q, k) / q.size(-1) ** 0.5
    if causal:
        mask = torch.ones(q.size(0), q.size(0), dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    ctx = torch.einsum("bnqk,kbnd->qbnd", torch.softmax(scores, -1), v)
    return ctx.reshape(q.size(0), q.size(1), -1)  # [S, b, np*hn]


def _check_all(rank: int, world_size: int, flash: bool = False,
               block_bytes: int | None = None) -> dict:
    """Max abs error of every case on this rank; ``flash``: the blocks on torch's flash
    kernel (CPU build, fp32), the plumbing the CUDA kernel shares; ``block_bytes``: the math
    path's chunk budget (small: several query-row chunks per block)."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)))
    cpa.FLASH_ON_CPU = flash
    saved_bytes = cpa.MATH_BLOCK_BYTES
    cpa.MATH_BLOCK_BYTES = block_bytes or saved_bytes
    dtype = torch.float32 if flash else torch.float64
    errors = {}
    for comm_type in cpa.CP_COMM_TYPES:
        # Four ranks run at a quarter of the speed: the unmasked case is CP=2's path.
        for causal in (True, False) if world_size == 2 else (True,):
            for groups in (HEADS, 4):
                torch.manual_seed(7)  # the same full tensors on every rank
                q = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, dtype=dtype)
                k = torch.randn(SEQ, BATCH, groups, HEAD_DIM, dtype=dtype)
                v = torch.randn(SEQ, BATCH, groups, HEAD_DIM, dtype=dtype)
                weight = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, dtype=dtype)
                full = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = _reference(*full, causal)
                (ref * weight).sum().backward()
                local = [cpa.split_for_cp(t, 0, world_size, rank).clone().requires_grad_()
                         for t in (q, k, v)]
                out = cpa.context_parallel_attention(*local, group, comm_type, causal)
                (out * cpa.split_for_cp(weight, 0, world_size, rank)).sum().backward()
                diffs = [(out - cpa.split_for_cp(ref, 0, world_size, rank)).abs().max()]
                for mine, whole in zip(local, full):
                    expected = cpa.split_for_cp(whole.grad, 0, world_size, rank)
                    diffs.append((mine.grad - expected).abs().max())
                key = f"{comm_type} {'causal' if causal else 'full'} g={groups}"
                errors[key] = max(float(d) for d in diffs)
    cpa.FLASH_ON_CPU = False
    cpa.MATH_BLOCK_BYTES = saved_bytes
    dist.destroy_process_group(group)
    return errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_attention_equals_full_attention(world_size):
    for rank, errors in enumerate(run_distributed(world_size, _check_all)):
        bad = {case: err for case, err in errors.items() if not err <= TOL}
        assert not bad, f"CP={world_size}, rank {rank}: output or dq/dk/dv differ: {bad}"
        assert len(errors) == (12 if world_size == 2 else 6)


def test_flash_kernel_blocks_equal_full_attention():
    """fp32 through the flash kernel's forward (log-sum-exp) and backward at CP=2."""
    for rank, errors in enumerate(run_distributed(2, _check_all, True)):
        bad = {case: err for case, err in errors.items() if not err <= 1e-5}
        assert not bad, f"flash blocks, rank {rank}: output or dq/dk/dv differ: {bad}"


def test_row_chunked_math_path_equals_full_attention():
    """CP=2 with a chunk budget of 3 query rows of 8 keys in fp64: every block runs in several
    chunks (the diagonal ones on a growing key prefix), same numbers as full attention."""
    per_row = BATCH * HEADS * (SEQ // 2) * 8  # bytes of one query row of a CP=2 block
    for rank, errors in enumerate(run_distributed(2, _check_all, False, 3 * per_row)):
        bad = {case: err for case, err in errors.items() if not err <= TOL}
        assert not bad, f"chunked math path, rank {rank}: output or dq/dk/dv differ: {bad}"
        assert len(errors) == 12


def _block_case(groups: int, sq: int, sk: int):
    torch.manual_seed(3)
    q = torch.randn(2, groups, HEADS // groups, sq, HEAD_DIM, dtype=torch.float64)
    k, v = (torch.randn(2, groups, sk, HEAD_DIM, dtype=torch.float64) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("groups", [HEADS, 2])
@pytest.mark.parametrize("q_chunk", [1, 3, 8])
def test_chunked_block_equals_unchunked_block(causal, groups, q_chunk):
    sq = 11
    q, k, v = _block_case(groups, sq, sq if causal else 7)
    whole_out, whole_lse = cpa.block_forward(q, k, v, 0.3, causal, q_chunk=sq)
    out, lse = cpa.block_forward(q, k, v, 0.3, causal, q_chunk=q_chunk)
    assert (out - whole_out).abs().max() <= 1e-13 and (lse - whole_lse).abs().max() <= 1e-13
    dout = torch.randn_like(whole_out)
    whole = cpa.block_backward(q, k, v, whole_out, dout, whole_lse, 0.3, causal, q_chunk=sq)
    chunked = cpa.block_backward(q, k, v, whole_out, dout, whole_lse, 0.3, causal,
                                 q_chunk=q_chunk)
    for name, a, b in zip(("dq", "dk", "dv"), chunked, whole):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-13, name


def test_math_path_transients_stay_within_the_chunk_budget():
    """No tensor the math path makes for a 64 x 64 causal block (forward and backward) is
    larger than the chunk's scores: the ``s x s`` block never exists whole."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return result

    s, groups = 64, 2
    q, k, v = _block_case(groups, s, s)
    saved = cpa.MATH_BLOCK_BYTES
    cpa.MATH_BLOCK_BYTES = 2 * HEADS * 8 * 8 * s  # 8 query rows of scores (b = 2, fp64)
    try:
        with Largest():
            out, lse = cpa.block_forward(q, k, v, 0.3, True)
            cpa.block_backward(q, k, v, out, torch.ones_like(out), lse, 0.3, True)
    finally:
        cpa.MATH_BLOCK_BYTES = saved
    assert Largest.numel == 2 * HEADS * 8 * s  # one chunk's scores; the whole block: 8x that


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_chunk_split_round_trips(cp):
    t = torch.arange(2 * 24 * 3).view(2, 24, 3)
    pieces = [cpa.split_for_cp(t, 1, cp, r) for r in range(cp)]
    assert all(p.shape == (2, 24 // cp, 3) for p in pieces)
    assert torch.equal(cpa.merge_cp_pieces(pieces, 1), t)
    if cp == 2:  # chunks 0 and 3 on rank 0, 1 and 2 on rank 1 (Megatron-Core's order)
        assert pieces[0][0, :, 0].tolist() == [0, 3, 6, 9, 12, 15, 54, 57, 60, 63, 66, 69]
        assert pieces[1][0, :, 0].tolist() == [18, 21, 24, 27, 30, 33, 36, 39, 42, 45, 48, 51]


def test_split_refuses_an_indivisible_sequence():
    with pytest.raises(ValueError, match="not divisible by 2 x context-parallel size"):
        cpa.split_for_cp(torch.zeros(1, 10), 1, 2, 0)


def test_merge_of_partials_equals_the_softmax_over_the_union():
    torch.manual_seed(0)
    q = torch.randn(1, 1, 2, 5, 4, dtype=torch.float64)
    k = torch.randn(1, 1, 9, 4, dtype=torch.float64)
    v = torch.randn(1, 1, 9, 4, dtype=torch.float64)
    whole = cpa.block_forward(q, k, v, 0.5, False)
    merged = cpa.merge_partial(*cpa.block_forward(q, k[:, :, :4], v[:, :, :4], 0.5, False),
                               *cpa.block_forward(q, k[:, :, 4:], v[:, :, 4:], 0.5, False))
    assert torch.allclose(whole[0], merged[0]) and torch.allclose(whole[1], merged[1])
