"""The fused vocab-parallel cross entropy (megatron.fused_kernels._cpu's cross_entropy_stats /
cross_entropy_backward) equals the unfused PyTorch path: loss and logits gradient, fp32 to 1e-5,
with and without label smoothing, in place or not, at TP=1 and TP=2; bf16 logits read directly
(loss in fp32) equal the unfused path on their fp32 copy.

Vocabulary 4099 (odd, over two of the kernel's 2048-column streaming blocks) and targets on the
first and last ids of each rank's slice.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.fusions import fused_cross_entropy as cross_entropy
from megatron.core.fusions.fused_cross_entropy import fused_kernel_for
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tests.multiprocess import run_distributed

VOCAB = 4099 * 2  # TP=2 splits it into two odd halves of 4099
TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(vocab: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(5, 3, vocab, generator=gen) * 4).to(dtype)
    half = vocab // 2
    edges = torch.tensor([0, half - 1, half, vocab - 1])
    target = torch.cat([edges, torch.randint(0, vocab, (11,), generator=gen)]).view(5, 3)
    grad = torch.rand(5, 3, generator=gen)
    return logits, target, grad


def _loss_and_grad(logits, target, grad, group, *, fused, smoothing=0.0, inplace=False,
                   loss_dtype=None):
    leaf = logits.clone().requires_grad_(True)
    buffer = leaf * 1.0 if inplace else leaf  # in place needs a non-leaf, as the model's logits
    loss = vocab_parallel_cross_entropy(buffer, target, group, smoothing, inplace=inplace,
                                        loss_dtype=loss_dtype, fused=fused)
    loss.backward(grad)
    return loss.detach(), leaf.grad


@pytest.fixture(scope="module", autouse=True)
def _kernel_built():
    if fused_kernel_for(torch.zeros(1)) is None:
        pytest.fail("megatron.fused_kernels._cpu has no cross-entropy kernels: rebuild it "
                    "(pip install --no-build-isolation -e .)")


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_fused_equals_unfused_fp32(smoothing, inplace):
    logits, target, grad = _inputs(VOCAB)
    want = _loss_and_grad(logits, target, grad, None, fused=False, smoothing=smoothing)
    got = _loss_and_grad(logits, target, grad, None, fused=True, smoothing=smoothing,
                         inplace=inplace)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)


def test_bf16_logits_with_fp32_loss_equal_the_upcast_path():
    logits, target, grad = _inputs(VOCAB, torch.bfloat16)
    want = _loss_and_grad(logits, target, grad, None, fused=False, inplace=True,
                          loss_dtype=torch.float32)
    got = _loss_and_grad(logits, target, grad, None, fused=True, inplace=True,
                         loss_dtype=torch.float32)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], **TOL)
    # Both compute the gradient in fp32 and round it to bf16 once: at most one bf16 ulp apart.
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=2**-7, atol=1e-6)


def test_fused_leaves_a_leaf_alone_and_refuses_what_it_does_not_cover():
    logits, target, grad = _inputs(VOCAB)
    leaf = logits.clone().requires_grad_(True)
    vocab_parallel_cross_entropy(leaf, target, None, inplace=True, fused=True).backward(grad)
    assert torch.equal(leaf.detach(), logits)  # its gradient went to .grad, not over it
    with pytest.raises(ValueError, match="fused=True"):
        vocab_parallel_cross_entropy(logits.double(), target, None, fused=True)


def _tp_equivalence(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = ps.get_tensor_model_parallel_group()
    logits, target, grad = _inputs(VOCAB)
    local = logits.chunk(world_size, dim=-1)[rank]
    for smoothing in (0.0, 0.1):
        want_loss, want_grad = _loss_and_grad(logits, target, grad, None, fused=False,
                                              smoothing=smoothing)
        for inplace in (False, True):
            loss, local_grad = _loss_and_grad(local, target, grad, group, fused=True,
                                              smoothing=smoothing, inplace=inplace)
            torch.testing.assert_close(loss, want_loss, **TOL)
            torch.testing.assert_close(local_grad, want_grad.chunk(world_size, -1)[rank], **TOL)
    return True


def test_fused_tp2_equals_the_single_process_unfused_loss():
    assert run_distributed(2, _tp_equivalence) == [True, True]


# The compiled cross entropy of CUDA (fusions/fused_cross_entropy.py): its PyTorch functions,
# run uncompiled here and compiled once below (inductor compiles for the CPU too), in place of
# the CPU kernels.
class _Uncompiled(cross_entropy.CompiledKernels):
    def __init__(self):
        self._stats = cross_entropy.cross_entropy_stats
        self._grad = cross_entropy.cross_entropy_grad


def _through(provider, logits, target, grad, smoothing, loss_dtype=None):
    leaf = logits.clone().requires_grad_(True)
    loss = cross_entropy._FusedVocabParallelCrossEntropy.apply(
        provider, leaf, target, None, smoothing, False)
    loss = loss.to(loss_dtype or logits.dtype)
    loss.backward(grad)
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_compiled_paths_functions_equal_the_unfused_path(smoothing):
    logits, target, grad = _inputs(VOCAB)
    want = _loss_and_grad(logits, target, grad, None, fused=False, smoothing=smoothing)
    got = _through(_Uncompiled(), logits, target, grad, smoothing)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    bf16 = logits.to(torch.bfloat16)
    want = _loss_and_grad(bf16, target, grad, None, fused=False, loss_dtype=torch.float32)
    got = _through(_Uncompiled(), bf16, target, grad, 0.0, torch.float32)
    assert got[1].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=2**-7, atol=1e-6)


def test_the_compiled_cross_entropy_compiles_and_equals_the_unfused_path():
    logits, target, grad = _inputs(VOCAB)
    want = _loss_and_grad(logits, target, grad, None, fused=False)
    got = _through(cross_entropy.CompiledKernels(), logits, target, grad, 0.0)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
