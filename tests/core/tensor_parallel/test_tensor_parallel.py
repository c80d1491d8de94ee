"""Communication operators, parallel layers (also strided) and vocab-parallel cross entropy (also
in place, with label smoothing) at TP = 2 and 4 against single-process equivalents (float64):
outputs and input/weight gradients. The RNG tracker on the compute device (CUDA when present).

Tensors are made on ``device.get_device()``, where the layers put their parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core import device
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                           VocabParallelEmbedding, checkpoint,
                                           copy_to_tensor_model_parallel_region,
                                           gather_from_tensor_model_parallel_region,
                                           get_rng_tracker, init_method_normal,
                                           model_parallel_manual_seed,
                                           reduce_from_tensor_model_parallel_region,
                                           scatter_to_tensor_model_parallel_region,
                                           vocab_parallel_cross_entropy)
from megatron.core.tensor_parallel.utils import split_master_weight
from tests.multiprocess import run_distributed

DT = torch.float64
TOL = dict(rtol=1e-7, atol=1e-9)


def _rand(*shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=DT).to(device.get_device())


def _ids(values):
    return torch.tensor(values, device=device.get_device())


def _chunk(t, dim, tp, rank):
    return t.chunk(tp, dim=dim)[rank]


def _check_mappings(group, tp, rank):
    x = _rand(3, 8, seed=1).requires_grad_()
    g = _rand(3, 8, seed=2 + rank)  # a different upstream gradient per rank
    all_g = sum(_rand(3, 8, seed=2 + r) for r in range(tp))

    y = copy_to_tensor_model_parallel_region(x, group)
    assert torch.equal(y, x)
    y.backward(g)
    torch.testing.assert_close(x.grad, all_g, **TOL)  # f: all-reduce in backward

    x = _rand(3, 8, seed=10 + rank).requires_grad_()
    y = reduce_from_tensor_model_parallel_region(x, group)
    torch.testing.assert_close(y, sum(_rand(3, 8, seed=10 + r) for r in range(tp)), **TOL)
    y.backward(g)
    assert torch.equal(x.grad, g)  # g: identity in backward

    x = _rand(3, 8, seed=3).requires_grad_()
    y = scatter_to_tensor_model_parallel_region(x, group)
    assert torch.equal(y, _chunk(x, -1, tp, rank))
    y.backward(_chunk(all_g, -1, tp, rank))
    assert torch.equal(x.grad, all_g)  # backward all-gathers the slices

    full = _rand(3, 8, seed=4)
    x = _chunk(full, -1, tp, rank).clone().requires_grad_()
    y = gather_from_tensor_model_parallel_region(x, group)
    assert torch.equal(y, full)
    y.backward(all_g)
    assert torch.equal(x.grad, _chunk(all_g, -1, tp, rank))


def _pair(cls, group, seed, *args, **kwargs):
    """The reference layer (no TP) and the TP layer, from the same seed."""
    torch.manual_seed(seed)
    ref = cls(*args, tp_group=None, params_dtype=DT, **kwargs)
    torch.manual_seed(seed)
    par = cls(*args, tp_group=group, params_dtype=DT, **kwargs)
    return ref, par


def _check_column(group, tp, rank):
    init = init_method_normal(0.5)
    for gather in (True, False):
        ref, par = _pair(ColumnParallelLinear, group, 5, 6, 8, init_method=init,
                         gather_output=gather)
        ref.bias.data.copy_(_rand(8, seed=6))
        par.bias.data.copy_(_chunk(ref.bias.data, 0, tp, rank))
        assert par.weight.tensor_model_parallel and par.weight.partition_dim == 0
        assert torch.equal(par.weight, _chunk(ref.weight, 0, tp, rank))
        x_ref = _rand(4, 2, 6, seed=7).requires_grad_()
        x_par = x_ref.detach().clone().requires_grad_()
        g = _rand(4, 2, 8, seed=8)
        out_ref, _ = ref(x_ref)
        out_par, _ = par(x_par)
        if gather:
            torch.testing.assert_close(out_par, out_ref, **TOL)
            out_par.backward(g)
        else:
            torch.testing.assert_close(out_par, _chunk(out_ref, -1, tp, rank), **TOL)
            out_par.backward(_chunk(g, -1, tp, rank))
        out_ref.backward(g)
        torch.testing.assert_close(x_par.grad, x_ref.grad, **TOL)
        torch.testing.assert_close(par.weight.grad, _chunk(ref.weight.grad, 0, tp, rank), **TOL)
        torch.testing.assert_close(par.bias.grad, _chunk(ref.bias.grad, 0, tp, rank), **TOL)


def _check_row(group, tp, rank):
    init = init_method_normal(0.5)
    for input_is_parallel in (True, False):
        ref, par = _pair(RowParallelLinear, group, 9, 8, 6, init_method=init,
                         input_is_parallel=input_is_parallel)
        ref.bias.data.copy_(_rand(6, seed=10))
        par.bias.data.copy_(ref.bias.data)
        assert par.weight.tensor_model_parallel and par.weight.partition_dim == 1
        assert not par.bias.tensor_model_parallel
        x_ref = _rand(4, 2, 8, seed=11).requires_grad_()
        x_par = (_chunk(x_ref.detach(), -1, tp, rank) if input_is_parallel
                 else x_ref.detach()).clone().requires_grad_()
        g = _rand(4, 2, 6, seed=12)
        out_ref, _ = ref(x_ref)
        out_par, _ = par(x_par)
        torch.testing.assert_close(out_par, out_ref, **TOL)
        out_ref.backward(g)
        out_par.backward(g)
        want_x = _chunk(x_ref.grad, -1, tp, rank) if input_is_parallel else x_ref.grad
        torch.testing.assert_close(x_par.grad, want_x, **TOL)
        torch.testing.assert_close(par.weight.grad, _chunk(ref.weight.grad, 1, tp, rank), **TOL)
        torch.testing.assert_close(par.bias.grad, ref.bias.grad, **TOL)


def _check_embedding(group, tp, rank):
    vocab = 16
    ref, par = _pair(VocabParallelEmbedding, group, 13, vocab, 5,
                     init_method=init_method_normal(1.0))
    per = vocab // tp
    borders = [r * per for r in range(tp)] + [r * per - 1 for r in range(1, tp + 1)]
    ids = _ids([borders, list(range(len(borders)))[::-1]])  # [2, n]
    out_ref, out_par = ref(ids), par(ids)
    torch.testing.assert_close(out_par, out_ref, **TOL)
    g = _rand(*out_ref.shape, seed=14)
    out_ref.backward(g)
    out_par.backward(g)
    torch.testing.assert_close(par.weight.grad, _chunk(ref.weight.grad, 0, tp, rank), **TOL)


def _check_cross_entropy(group, tp, rank):
    vocab = 8 * tp
    per = vocab // tp
    logits = _rand(3, 4, vocab, seed=15) * 3
    borders = [r * per for r in range(tp)] + [r * per - 1 for r in range(1, tp + 1)]
    target = _ids((borders * 12)[:12]).view(3, 4)
    ref_logits = logits.clone().requires_grad_()
    ref_loss = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1),
                               reduction="none").view(3, 4)
    local = _chunk(logits, -1, tp, rank).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    g = _rand(3, 4, seed=16)
    ref_loss.backward(g)
    loss.backward(g)
    torch.testing.assert_close(local.grad, _chunk(ref_logits.grad, -1, tp, rank), **TOL)
    assert torch.equal(local.detach(), _chunk(logits, -1, tp, rank))  # input untouched

    # Label smoothing: same loss and gradient as without TP (full-vocabulary mean).
    ref_logits = logits.clone().requires_grad_()
    ref_loss = vocab_parallel_cross_entropy(ref_logits, target, None, label_smoothing=0.1)
    eps = 0.1 * vocab / (vocab - 1)
    logp = torch.log_softmax(logits, -1)
    want = -(1 - eps) * logp.gather(-1, target.unsqueeze(-1)).squeeze(-1) - eps * logp.mean(-1)
    torch.testing.assert_close(ref_loss, want, **TOL)
    local = _chunk(logits, -1, tp, rank).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group, label_smoothing=0.1)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    ref_loss.backward(g)
    loss.backward(g)
    torch.testing.assert_close(local.grad, _chunk(ref_logits.grad, -1, tp, rank), **TOL)

    # In place (GPTModel's path) with label smoothing: the same loss and gradient; the buffer,
    # a non-leaf like the output layer's logits, ends up holding this rank's softmax slice.
    local = _chunk(logits, -1, tp, rank).clone().requires_grad_()
    buffer = local * 1.0
    loss = vocab_parallel_cross_entropy(buffer, target, group, label_smoothing=0.1,
                                        inplace=True)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(buffer.detach(), _chunk(torch.softmax(logits, -1), -1, tp, rank),
                               **TOL)
    loss.backward(g)
    torch.testing.assert_close(local.grad, _chunk(ref_logits.grad, -1, tp, rank), **TOL)


def _check_strided(group, tp, rank):
    """stride > 1 (fused weights): rank r holds blocks r, r + p, ... of p * stride. Outputs and
    gradients are those slices of the full layer's; gather_output / a scattered input use the
    full layer's order."""
    stride, init = 3, init_method_normal(0.5)
    width = 2 * tp * stride  # blocks of 2

    def mine(t, dim):
        return split_master_weight(t, dim, tp, rank, stride)

    for gather in (False, True):
        ref, par = _pair(ColumnParallelLinear, group, 5, 6, width, init_method=init,
                         gather_output=gather, stride=stride)
        ref.bias.data.copy_(_rand(width, seed=6))
        par.bias.data.copy_(mine(ref.bias.data, 0))
        assert par.weight.partition_stride == stride
        assert torch.equal(par.weight, mine(ref.weight, 0))
        x_ref = _rand(4, 2, 6, seed=7).requires_grad_()
        x_par = x_ref.detach().clone().requires_grad_()
        g = _rand(4, 2, width, seed=8)
        out_ref, _ = ref(x_ref)
        out_par, _ = par(x_par)
        want, g_par = (out_ref, g) if gather else (mine(out_ref, -1), mine(g, -1))
        torch.testing.assert_close(out_par, want, **TOL)
        out_ref.backward(g)
        out_par.backward(g_par)
        torch.testing.assert_close(x_par.grad, x_ref.grad, **TOL)
        torch.testing.assert_close(par.weight.grad, mine(ref.weight.grad, 0), **TOL)
        torch.testing.assert_close(par.bias.grad, mine(ref.bias.grad, 0), **TOL)

    for input_is_parallel in (True, False):
        ref, par = _pair(RowParallelLinear, group, 9, width, 5, init_method=init,
                         input_is_parallel=input_is_parallel, stride=stride)
        assert torch.equal(par.weight, mine(ref.weight, 1))
        x_ref = _rand(4, 2, width, seed=11).requires_grad_()
        x_par = (mine(x_ref.detach(), -1) if input_is_parallel
                 else x_ref.detach()).clone().requires_grad_()
        g = _rand(4, 2, 5, seed=12)
        out_ref, _ = ref(x_ref)
        out_par, _ = par(x_par)
        torch.testing.assert_close(out_par, out_ref, **TOL)
        out_ref.backward(g)
        out_par.backward(g)
        want_x = mine(x_ref.grad, -1) if input_is_parallel else x_ref.grad
        torch.testing.assert_close(x_par.grad, want_x, **TOL)
        torch.testing.assert_close(par.weight.grad, mine(ref.weight.grad, 1), **TOL)


def _check_checkpoint_distributed(group, tp, rank):
    """checkpoint(..., distribute_saved_activations=True) keeps 1/tp of the input and
    reproduces dropout (default and TP streams) on recompute."""
    def fn(x, w):
        y = F.dropout(x @ w, p=0.5, training=True)
        with get_rng_tracker().fork():
            return F.dropout(y, p=0.5, training=True)

    grads = []
    for use_ckpt in (False, True):
        model_parallel_manual_seed(21, rank)
        x = _rand(4, 2 * tp, seed=17).requires_grad_()
        w = _rand(2 * tp, 3, seed=18).requires_grad_()
        out = checkpoint(fn, True, x, w, tp_group=group) if use_ckpt else fn(x, w)
        out.sum().backward()
        grads.append((out.detach(), x.grad, w.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **TOL)


def _tensor_parallel_checks(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = ps.get_tensor_model_parallel_group()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for check in (_check_mappings, _check_column, _check_row, _check_strided, _check_embedding,
                  _check_cross_entropy, _check_checkpoint_distributed):
        check(group, tp, tp_rank)
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_ops_match_single_process(tp):
    assert run_distributed(tp, _tensor_parallel_checks) == [True] * tp


def test_noop_without_group():
    x = torch.randn(2, 4, requires_grad=True)
    for op in (copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
               scatter_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region):
        assert op(x, None) is x


def test_split_master_weight_with_stride():
    w = torch.arange(8).view(8, 1)
    # stride 2, 2 ranks: blocks of 2 rows, rank 0 keeps blocks 0 and 2.
    assert split_master_weight(w, 0, 2, 0, stride=2).view(-1).tolist() == [0, 1, 4, 5]
    assert split_master_weight(w, 0, 2, 1, stride=2).view(-1).tolist() == [2, 3, 6, 7]


def test_checkpoint_restores_rng_for_dropout():
    def fn(x):
        with get_rng_tracker().fork():
            y = F.dropout(x, p=0.5, training=True)
        return F.dropout(y * 2, p=0.5, training=True)

    results = []
    for use_ckpt in (False, True):
        model_parallel_manual_seed(3, 0)
        x = torch.randn(64, dtype=DT, device=device.get_device(), requires_grad=True)
        out = checkpoint(fn, False, x) if use_ckpt else fn(x)
        out.sum().backward()
        results.append((out.detach(), x.grad, torch.get_rng_state()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[0][2], results[1][2])


def test_inplace_cross_entropy_marks_logits_dirty():
    """inplace=True marks the overwritten logits dirty: autograd moves their history onto the
    loss function (gradients still reach the producer of the logits) and refuses a leaf."""
    logits = _rand(3, 4, 10, seed=20)
    target = _ids([[0, 9, 3, 4]] * 3)
    leaf = logits.clone().requires_grad_()
    buffer = leaf * 2.0
    loss = vocab_parallel_cross_entropy(buffer, target, None, inplace=True)
    torch.testing.assert_close(loss, vocab_parallel_cross_entropy(logits * 2.0, target, None),
                               **TOL)
    assert type(buffer.grad_fn).__name__ == "_VocabParallelCrossEntropyBackward"
    loss.sum().backward()
    ref = logits.clone().requires_grad_()
    torch.nn.functional.cross_entropy(ref.mul(2.0).view(-1, 10), target.view(-1),
                                      reduction="sum").backward()
    torch.testing.assert_close(leaf.grad, ref.grad, **TOL)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        vocab_parallel_cross_entropy(logits.clone().requires_grad_(), target, None, inplace=True)


def _fork_draws(dev):
    """Draws on ``dev`` inside and after the tracker's fork, as TP ranks 0 and 1 would make."""
    inside, outside = [], []
    for rank in (0, 1):
        model_parallel_manual_seed(5, rank)
        with get_rng_tracker().fork():
            inside.append(torch.rand(32, device=dev))
        outside.append(torch.rand(32, device=dev))
    return inside, outside


def test_rng_tracker_fork_on_compute_device():
    """The TP stream differs per TP rank; the default stream (after the fork) does not."""
    inside, outside = _fork_draws(device.get_device())
    assert not torch.equal(*inside)
    assert torch.equal(*outside)


@pytest.mark.skipif(not device.accelerator_available(),
                    reason="the tracker forks the CUDA generator only on a CUDA device")
def test_rng_tracker_forks_cuda_stream_per_rank():
    dev = device.get_device()
    assert dev.type == "cuda"
    model_parallel_manual_seed(5, 0)
    cuda_state, cpu_state = device.accelerator_rng_state(), torch.get_rng_state()
    with get_rng_tracker().fork():
        assert not torch.equal(device.accelerator_rng_state(), cuda_state)  # TP stream in
        assert torch.equal(torch.get_rng_state(), cpu_state)  # the CPU generator untouched
        torch.rand(8, device=dev)
    assert torch.equal(device.accelerator_rng_state(), cuda_state)  # default stream back
    inside, outside = _fork_draws(dev)
    assert not torch.equal(*inside)
    assert torch.equal(*outside)
