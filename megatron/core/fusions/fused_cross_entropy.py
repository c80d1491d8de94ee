"""The fused vocab-parallel cross entropy (Megatron-core's
``fused_vocab_parallel_cross_entropy``) and the kernels it runs on.

Each TP rank holds logits ``[..., V/p]``; as on the unfused path
(:mod:`megatron.core.tensor_parallel.cross_entropy`, which chooses between the two) only three
``[...]``-sized all-reduces cross ranks. Two sets of kernels, equal to the unfused path to 1e-5
in fp32 (tests/fused_kernels/test_fused_cross_entropy.py):

* the C++ kernels of ``megatron.fused_kernels._cpu``, for fp32/bf16/fp16 CPU logits when the
  extension is built: the forward reads the logits once (an online max and sum of exponentials
  per row) and writes nothing of their size; the backward rebuilds the softmax from the saved
  row statistics and writes the gradient in one pass, over the logits buffer when ``inplace``.
  Half-precision logits are read as they are and computed in fp32, so
  ``loss_dtype=torch.float32`` costs no fp32 copy of them.
* compiled (CUDA): the same two steps written as PyTorch ops (:func:`cross_entropy_stats`,
  :func:`cross_entropy_grad`) and compiled by ``torch.compile`` into one reduction (max, sum of
  exponentials, sum) and one pointwise gradient kernel, reading the half logits as they are, where
  the unfused path makes six passes over an fp32 copy of the logits (the step times with and
  without it: docs/benchmarks.md). Used for fp32/bf16/fp16 CUDA logits unless
  ``MEGATRON_COMPILED_CROSS_ENTROPY=0``; if compiling fails it says so once and the same
  functions run uncompiled.
"""

from __future__ import annotations

import os

import torch

from megatron.core import comm
from megatron.core.fusions import kernels
from megatron.core.log import log_rank_0


def _tp_all_reduce(x: torch.Tensor, tp_group, op: str = "sum") -> torch.Tensor:
    comm.all_reduce(x, tp_group, op=op)  # nothing to do where the group is this rank alone
    return x


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """The fused kernels' loss (module docstring). Returns the fp32 loss."""

    @staticmethod
    def forward(ctx, ext, logits, target, tp_group, label_smoothing, inplace):
        local_max, local_sum_exp, local_sum = ext.cross_entropy_stats(logits)  # fp32 [...]
        global_max = _tp_all_reduce(local_max.clone(), tp_group, op="max")
        # Each rank's sum of exponentials is relative to its own max: rescale to the global one.
        sum_exp = _tp_all_reduce(local_sum_exp * torch.exp(local_max - global_max), tp_group)

        part = logits.size(-1)
        start = part * comm.rank(tp_group)  # this rank's vocabulary is [start, start + part)
        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, -1)  # -1: another rank's id
        predicted = torch.gather(logits, -1, local_target.clamp(min=0).unsqueeze(-1))
        predicted = _tp_all_reduce(predicted.squeeze(-1).float().masked_fill(outside, 0.0),
                                tp_group)
        log_normaliser = torch.log(sum_exp) + global_max  # log sum_v exp(l_v)
        loss = log_normaliser - predicted

        vocab_size = part * comm.world_size(tp_group)
        smoothing = 0.0
        if label_smoothing > 0:
            # As the unfused path: (1 - e) on the target, e / V spread over the vocabulary.
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            sum_log_probs = _tp_all_reduce(local_sum - part * log_normaliser, tp_group)
            loss = (1.0 - smoothing) * loss - smoothing * sum_log_probs / vocab_size

        ctx.save_for_backward(logits, global_max, sum_exp, local_target)
        ctx.ext, ctx.inplace = ext, inplace
        ctx.on_target, ctx.uniform = 1.0 - smoothing, smoothing / vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, global_max, sum_exp, local_target = ctx.saved_tensors
        grad = ctx.ext.cross_entropy_backward(logits, global_max, sum_exp, local_target,
                                              grad_loss, ctx.on_target, ctx.uniform,
                                              ctx.inplace)
        return None, grad, None, None, None, None


def cross_entropy_stats(logits: torch.Tensor):
    """Per row of ``logits`` ``[..., V/p]``, in fp32: the max, the sum of exponentials relative
    to that max and the sum of the logits (what the CPU kernel of that name returns)."""
    x = logits.float()
    row_max = x.amax(dim=-1)
    return row_max, torch.exp(x - row_max.unsqueeze(-1)).sum(dim=-1), x.sum(dim=-1)


def cross_entropy_grad(logits: torch.Tensor, global_max: torch.Tensor, sum_exp: torch.Tensor,
                       local_target: torch.Tensor, grad_loss: torch.Tensor, on_target: float,
                       uniform: float) -> torch.Tensor:
    """``(softmax - on_target onehot(target) - uniform) * grad_loss`` in the logits' dtype
    (``local_target`` -1 where another rank holds the id); the CPU kernel's backward."""
    x = logits.float()
    softmax = torch.exp(x - global_max.unsqueeze(-1)) / sum_exp.unsqueeze(-1)
    ids = torch.arange(x.size(-1), device=x.device)
    hit = (ids == local_target.unsqueeze(-1)).to(x.dtype)
    return ((softmax - on_target * hit - uniform) * grad_loss.unsqueeze(-1)).to(logits.dtype)


class CompiledKernels:
    """The fused kernels' interface over the two functions above, compiled by
    ``torch.compile`` (once per shape). Where compiling fails, one log line says why and the
    same functions run uncompiled from then on (same results, more passes over memory)."""

    def __init__(self) -> None:
        self._stats = torch.compile(cross_entropy_stats, dynamic=False)
        self._grad = torch.compile(cross_entropy_grad, dynamic=False)

    def _uncompiled(self, err: Exception) -> None:
        log_rank_0(f"> cross entropy: torch.compile failed ({type(err).__name__}: {err}); "
                   "running its PyTorch ops uncompiled")
        self._stats, self._grad = cross_entropy_stats, cross_entropy_grad

    def cross_entropy_stats(self, logits):
        try:
            return self._stats(logits)
        except Exception as err:  # noqa: BLE001 - a compiler failure must not stop training
            if self._stats is cross_entropy_stats:
                raise
            self._uncompiled(err)
            return self._stats(logits)

    def cross_entropy_backward(self, logits, global_max, sum_exp, local_target, grad_loss,
                               on_target, uniform, inplace):
        del inplace  # a fresh gradient: the logits' buffer is the caller's to free
        args = (logits, global_max, sum_exp, local_target, grad_loss, on_target, uniform)
        try:
            return self._grad(*args)
        except Exception as err:  # noqa: BLE001 - as above
            if self._grad is cross_entropy_grad:
                raise
            self._uncompiled(err)
            return self._grad(*args)


_compiled: CompiledKernels | None = None


def _compiled_kernels(logits: torch.Tensor) -> CompiledKernels | None:
    """The compiled cross entropy for CUDA logits (module docstring), else None."""
    if (logits.device.type != "cuda" or logits.dtype not in kernels.KERNEL_DTYPES
            or os.environ.get("MEGATRON_COMPILED_CROSS_ENTROPY", "1") == "0"):
        return None
    global _compiled
    if _compiled is None:
        _compiled = CompiledKernels()
    return _compiled


def fused_kernel_for(logits: torch.Tensor):
    """The kernels covering ``logits``: the CPU extension's, the compiled ones on CUDA, or
    ``None``."""
    if logits.dim() < 1:
        return None
    return kernels.cpu_kernel("cross_entropy_stats", logits) or _compiled_kernels(logits)


def fused_vocab_parallel_cross_entropy(ext, logits: torch.Tensor, target: torch.Tensor,
                                       tp_group, label_smoothing: float,
                                       inplace: bool) -> torch.Tensor:
    """The fp32 per-token loss of ``logits`` ``[..., V/p]`` through ``ext`` (one of
    :func:`fused_kernel_for`'s answers); the gradient overwrites the logits when ``inplace`` and
    they are neither a leaf nor a view with gaps."""
    # A leaf's memory is its value: never overwrite it, whatever the caller allows.
    inplace = inplace and not logits.is_leaf and logits.is_contiguous()
    return _FusedVocabParallelCrossEntropy.apply(ext, logits.contiguous(), target, tp_group,
                                                 label_smoothing, inplace)
