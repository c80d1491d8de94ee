"""Cross entropy over vocabulary-split logits, without gathering them (paper, section 3).

Each TP rank holds logits ``[..., V/p]``. Only three ``[...]``-sized all-reduces are needed
(the max, the sum of exponentials and the target logit), so the communication is
batch x sequence, not batch x sequence x vocabulary.

:func:`vocab_parallel_cross_entropy` runs the fused loss of
:mod:`megatron.core.fusions.fused_cross_entropy` (the CPU extension's kernels, or the compiled
ones on CUDA) where it covers the logits, else the unfused one here: PyTorch ops (max,
subtract, exp, sum, divide; the softmax kept for the backward), for float64, the extension
missing, or a device with neither. The two agree to 1e-5 in fp32
(tests/fused_kernels/test_fused_cross_entropy.py).
"""

from __future__ import annotations

import torch

from megatron.core import comm
# The module, not its names: looked up per call, so bench/profile_step.py can switch it off.
from megatron.core.fusions import fused_cross_entropy
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
    ext = None if fused is False else fused_cross_entropy.fused_kernel_for(logits)
    if fused and ext is None:
        raise ValueError("vocab_parallel_cross_entropy(fused=True): no fused kernel covers "
                         f"{logits.dtype} logits on {logits.device.type} (the CPU extension "
                         "megatron.fused_kernels._cpu handles fp32/bf16/fp16)")
    if ext is not None:
        loss = fused_cross_entropy.fused_vocab_parallel_cross_entropy(
            ext, logits, target, tp_group, label_smoothing, inplace)
        return loss.to(loss_dtype)
    if logits.dtype != loss_dtype:
        logits = logits.to(loss_dtype)  # a fresh copy: the in-place path may reuse it
    loss, _ = _VocabParallelCrossEntropy.apply(logits, target, tp_group, label_smoothing, inplace)
    return loss
