"""Cross entropy over vocabulary-split logits, without gathering them (paper, section 3).

Each TP rank holds logits ``[..., V/p]``. Only three ``[...]``-sized all-reduces are needed
(the max, the sum of exponentials and the target logit), so the communication is
batch x sequence, not batch x sequence x vocabulary.

Two implementations, equal to 1e-5 in fp32 (tests/fused_kernels/test_fused_cross_entropy.py):

* fused (Megatron-core's ``fused_vocab_parallel_cross_entropy``; the C++ kernels of
  ``megatron.fused_kernels._cpu``), chosen for fp32/bf16/fp16 CPU logits when the extension is
  built: the forward reads the logits once (an online max and sum of exponentials per row) and
  writes nothing of their size; the backward rebuilds the softmax from the saved row statistics
  and writes the gradient in one pass, over the logits buffer when ``inplace``. Half-precision
  logits are read as they are and computed in fp32, so ``loss_dtype=torch.float32`` costs no
  fp32 copy of them.
* compiled (CUDA): the same two steps as the fused kernels, written as PyTorch ops and
  compiled by ``torch.compile`` into one reduction (max, sum of exponentials, sum) and one
  pointwise gradient kernel, reading the half logits as they are. On an H200 at GPT-2-small
  (16 x 1024 tokens x 50304) the unfused path made six passes over an fp32 copy of the logits
  (~13 ms of a 53 ms step). Used for fp32/bf16/fp16 CUDA logits unless
  ``MEGATRON_COMPILED_CROSS_ENTROPY=0``; if compiling fails it says so once and the unfused
  path runs.
* unfused (PyTorch ops: max, subtract, exp, sum, divide; the softmax kept for the backward),
  everywhere else (float64, the extension missing, a device with neither).
"""

from __future__ import annotations

import os

import torch

from megatron.core import comm
from megatron.core.fusions import kernels
from megatron.core.log import log_rank_0
from megatron.core.tensor_parallel.utils import ProcessGroup, tp_rank, tp_world_size, vocab_range


def _all_reduce(x: torch.Tensor, tp_group: ProcessGroup | None, op: str = "sum") -> torch.Tensor:
    if tp_world_size(tp_group) > 1:
        comm.all_reduce(x, tp_group, op=op)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, label_smoothing, inplace):
        # Subtract the global max for a stable exp. With `inplace` the caller's logits buffer is
        # reused for the shifted logits, their exp and the softmax: on CPU every fresh
        # logits-sized temporary (412 MB at mb 8 x seq 256 x 50k) costs its page faults as well as
        # its memory traffic. Otherwise a new tensor, and the caller's logits stay.
        logits_max = _all_reduce(logits.max(dim=-1)[0], tp_group, op="max")
        if inplace:
            logits = logits.sub_(logits_max.unsqueeze(-1))  # [..., V/p]
        else:
            logits = logits - logits_max.unsqueeze(-1)  # [..., V/p]

        part = logits.size(-1)
        start, end = vocab_range(part, tp_rank(tp_group))
        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        # Target logit: only the rank holding the id contributes, the others add 0.
        predicted = torch.gather(logits, -1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = _all_reduce(predicted.masked_fill(outside, 0.0), tp_group)

        sum_log_probs = None
        if label_smoothing > 0 and inplace:
            # Needs the shifted logits, which the in-place exp below overwrites.
            sum_shifted = logits.sum(dim=-1)
        exp_logits = logits.exp_() if inplace else torch.exp(logits)
        sum_exp = _all_reduce(exp_logits.sum(dim=-1), tp_group)
        loss = torch.log(sum_exp) - predicted  # [...]
        if label_smoothing > 0:
            # Sum over the vocabulary of log-probs = sum(shifted logits) - V/p * log(sum_exp).
            if not inplace:
                sum_shifted = logits.sum(dim=-1)
            sum_log_probs = _all_reduce(sum_shifted - part * torch.log(sum_exp), tp_group)
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))

        vocab_size = part * tp_world_size(tp_group)
        smoothing = 0.0
        if label_smoothing > 0:
            # Megatron's form: (1 - e) on the target, e / (V - 1) spread over the other ids.
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            # The mean log-prob runs over the full vocabulary (Megatron-LM averages over the
            # local partition only, which changes the loss with the TP size).
            loss = (1.0 - smoothing) * loss - smoothing * sum_log_probs / vocab_size

        ctx.save_for_backward(softmax, outside, local_target)
        ctx.smoothing, ctx.vocab_size, ctx.inplace = smoothing, vocab_size, inplace
        # The softmax is returned only because autograd requires every input marked dirty to be
        # an output; the wrapper drops it, so its gradient is always None (not materialized).
        ctx.set_materialize_grads(False)
        if inplace:
            # The caller's buffer now holds the softmax: autograd rebases its history onto this
            # function and refuses a leaf that requires grad, instead of silently going stale.
            ctx.mark_dirty(logits)
        else:
            ctx.mark_non_differentiable(softmax)
        return loss, softmax

    @staticmethod
    def backward(ctx, grad_output, _grad_softmax):
        softmax, outside, local_target = ctx.saved_tensors
        # d loss / d logits = softmax - (1 - s) onehot(target) - s / V
        # In place on the saved softmax when allowed (Megatron-LM does so always): this backward
        # then runs once only (no retain_graph).
        grad = softmax if ctx.inplace else softmax.clone()
        update = (1.0 - ctx.smoothing) * (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -update.unsqueeze(-1))
        if ctx.smoothing > 0:
            grad.sub_(ctx.smoothing / ctx.vocab_size)
        grad.mul_(grad_output.unsqueeze(-1))
        return grad, None, None, None, None


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """The fused kernels' loss: see the module docstring. Returns the fp32 loss."""

    @staticmethod
    def forward(ctx, ext, logits, target, tp_group, label_smoothing, inplace):
        local_max, local_sum_exp, local_sum = ext.cross_entropy_stats(logits)  # fp32 [...]
        global_max = _all_reduce(local_max.clone(), tp_group, op="max")
        # Each rank's sum of exponentials is relative to its own max: rescale to the global one.
        sum_exp = _all_reduce(local_sum_exp * torch.exp(local_max - global_max), tp_group)

        part = logits.size(-1)
        start, end = vocab_range(part, tp_rank(tp_group))
        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, -1)  # -1: another rank's id
        predicted = torch.gather(logits, -1, local_target.clamp(min=0).unsqueeze(-1))
        predicted = _all_reduce(predicted.squeeze(-1).float().masked_fill(outside, 0.0),
                                tp_group)
        log_normaliser = torch.log(sum_exp) + global_max  # log sum_v exp(l_v)
        loss = log_normaliser - predicted

        vocab_size = part * tp_world_size(tp_group)
        smoothing = 0.0
        if label_smoothing > 0:
            # As the unfused path: (1 - e) on the target, e / V spread over the vocabulary.
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            sum_log_probs = _all_reduce(local_sum - part * log_normaliser, tp_group)
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
    if (logits.device.type != "cuda" or logits.dtype not in kernels.CPU_KERNEL_DTYPES
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


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 tp_group: ProcessGroup | None,
                                 label_smoothing: float = 0.0, *,
                                 inplace: bool = False,
                                 loss_dtype: torch.dtype | None = None,
                                 fused: bool | None = None) -> torch.Tensor:
    """Per-token cross entropy of vocabulary-split logits.

    Args:
        vocab_parallel_logits: ``[..., V/p]``, this rank's slice of the vocabulary.
        target: ``[...]`` int64 ids in ``[0, V)``.
        tp_group: the TP process group (``None`` = this rank alone: no tensor parallelism).
        label_smoothing: Megatron-style smoothing (0 = off).
        inplace: the logits' memory may be reused (overwritten with the softmax by the unfused
            forward, with the gradient by either backward), and the backward may then run only
            once. For logits that nothing else reads, such as the output layer's temporary in
            :class:`GPTModel`. The unfused path refuses a leaf that requires grad (autograd
            raises: the logits are marked dirty); the fused one then leaves the leaf alone.
        loss_dtype: the loss's dtype (default: the logits'). ``torch.float32`` with half logits
            is Megatron's loss in fp32: the fused kernels read the half logits directly, the
            unfused path computes on an fp32 copy.
        fused: force (True) or forbid (False) the fused kernels; ``None`` uses them where they
            cover the logits. True raises if they do not.

    Returns:
        The unreduced loss ``[...]`` (same on every TP rank).
    """
    logits = vocab_parallel_logits
    loss_dtype = loss_dtype or logits.dtype
    ext = None if fused is False else fused_kernel_for(logits)
    if fused and ext is None:
        raise ValueError("vocab_parallel_cross_entropy(fused=True): no fused kernel covers "
                         f"{logits.dtype} logits on {logits.device.type} (the CPU extension "
                         "megatron.fused_kernels._cpu handles fp32/bf16/fp16)")
    if ext is not None:
        # A leaf's memory is its value: never overwrite it, whatever the caller allows.
        inplace = inplace and not logits.is_leaf and logits.is_contiguous()
        loss = _FusedVocabParallelCrossEntropy.apply(ext, logits.contiguous(), target,
                                                     tp_group, label_smoothing, inplace)
        return loss.to(loss_dtype)
    if logits.dtype != loss_dtype:
        logits = logits.to(loss_dtype)  # a fresh copy: the in-place path may reuse it
    loss, _ = _VocabParallelCrossEntropy.apply(logits, target, tp_group, label_smoothing, inplace)
    return loss
