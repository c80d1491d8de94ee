"""Megatron-LM's fused scale-mask-softmax of the unfused attention path.

Three kernels, as Megatron's ``FusedScaleMaskSoftmax`` chooses them: causal attention without an
explicit mask -> ``scaled_upper_triang_masked_softmax``; a boolean mask (True = masked out,
``[b or 1, 1, sq, sk]``, broadcast over heads) -> ``scaled_masked_softmax``; no mask ->
``scaled_softmax``. Each computes ``softmax(scale * x)`` in fp32 whatever the input dtype
(fp32, fp16, bf16) and returns the input dtype, so half precision gets the accuracy of
``--attention-softmax-in-fp32`` for free.

Masked scores are -10000 (as the PyTorch path's ``masked_fill``), but a row whose every score is
masked returns zeros, as Megatron's kernels do, where the PyTorch path returns a uniform row.
Such rows only occur for padding queries; the attention (``megatron.core.transformer.attention``)
gives them what Megatron-LM gives for the dtype in use, whichever path computed them.

Legend: b batch, np heads on this rank, sq queries, sk keys.
"""

from __future__ import annotations

from types import ModuleType

import torch

from megatron.core.fusions import kernels


class _ScaledSoftmax(torch.autograd.Function):
    """One of the forward kernels; the backward is ``scale * y * (dy - sum(dy * y))`` (over the
    lower triangle only for the causal kernel)."""

    @staticmethod
    def forward(ctx, ext: ModuleType, kind: str, scores: torch.Tensor,
                mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        if kind == "causal":
            b, np_, sq, sk = scores.shape
            probs = ext.scaled_upper_triang_masked_softmax_forward(
                scores.reshape(b * np_, sq, sk), scale).view(b, np_, sq, sk)
        elif kind == "masked":
            probs = ext.scaled_masked_softmax_forward(scores, mask, scale)
        else:
            probs = ext.scaled_softmax_forward(scores, scale)
        ctx.ext, ctx.scale, ctx.causal = ext, scale, kind == "causal"
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad_probs: torch.Tensor):
        (probs,) = ctx.saved_tensors
        grad_probs = grad_probs.contiguous()
        if ctx.causal:  # only the lower triangle is live: half the work
            b, np_, sq, sk = probs.shape
            grad = ctx.ext.scaled_upper_triang_masked_softmax_backward(
                grad_probs.view(b * np_, sq, sk), probs.view(b * np_, sq, sk),
                ctx.scale).view(b, np_, sq, sk)
        else:
            grad = ctx.ext.softmax_backward(grad_probs, probs, ctx.scale)
        return None, None, grad, None, None


def kernel_for(scores: torch.Tensor, kind: str) -> ModuleType | None:
    """The extension that runs the ``kind`` (causal/masked/plain) softmax over ``scores``, or
    ``None`` (dtype or device not covered, extension missing, or eager is faster there)."""
    if scores.dtype not in kernels.KERNEL_DTYPES or scores.dim() != 4:
        return None
    return kernels.preferred(f"softmax_{kind}", scores.device.type)


def fused_scale_mask_softmax(scores: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                             scale: float) -> torch.Tensor | None:
    """``softmax(mask(scale * scores))`` over the last dim with the fused kernels.

    Args:
        scores: ``[b, np, sq, sk]`` attention scores.
        mask: boolean ``[b or 1, 1, sq, sk]``, True = masked out; ``None`` for none (or, with
            ``causal``, the causal mask, keys after the query's position, sq <= sk).
        causal: without ``mask``, mask the future keys.
        scale: multiplies the scores before masking (query-key layer scaling's coefficient).

    Returns:
        Probabilities in ``scores``' dtype, or ``None`` when no kernel covers these inputs (the
        caller runs its PyTorch path).
    """
    kind = "masked" if mask is not None else "causal" if causal else "plain"
    ext = kernel_for(scores, kind)
    if ext is None:
        return None
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.size(1) != 1:
            return None
        mask = mask.expand(mask.size(0), 1, scores.size(2), scores.size(3))
    return _ScaledSoftmax.apply(ext, kind, scores, mask, float(scale))
