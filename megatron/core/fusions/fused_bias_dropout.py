"""Megatron-LM's bias + dropout + residual add (``--bias-dropout-fusion``, on by default).

``residual + dropout(x + bias)``. Fused, it runs as TorchScript functions specialised for training
and inference (Megatron's ``bias_dropout_add_fused_train``/``_inference``), which TorchScript's
fuser merges into one kernel where it fuses (CUDA; torch keeps its CPU fuser off, so on CPU the
same aten ops run one after the other). The values, and the dropout's draws from the default
generator, are those of the eager expression: the switch never changes the numerics on CPU.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


def _eager(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, prob: float,
           training: bool) -> torch.Tensor:
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=training)


# torch 2.13 deprecates torch.jit.script in favour of torch.compile, which would compile C++
# at launch on CPU (what these kernels avoid); the scripted functions still work.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)

    @torch.jit.script
    def _fused_train(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                     prob: float) -> torch.Tensor:
        return residual + F.dropout(x + bias, p=prob, training=True)

    @torch.jit.script
    def _fused_inference(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                         prob: float) -> torch.Tensor:
        return residual + F.dropout(x + bias, p=prob, training=False)


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                     prob: float, training: bool, fused: bool = True) -> torch.Tensor:
    """``residual + dropout(x + bias)`` (``bias`` may be ``None``: no linear biases).

    Args:
        x: the sublayer's output before its bias, ``[s, b, h]``.
        bias: ``[h]`` or ``None``.
        residual: ``[s, b, h]``.
        prob: dropout probability.
        training: drop (True) or pass through.
        fused: run the TorchScript-fused version (``--bias-dropout-fusion``).
    """
    # Traced by torch.compile (--compile-layers): inductor fuses the eager ops itself.
    if not fused or bias is None or torch.compiler.is_compiling():
        return _eager(x, bias, residual, prob, training)
    if training and prob > 0:
        return _fused_train(x, bias, residual, prob)
    # p = 0 in training too: the scripted dropout would still draw a bernoulli mask (a wasted
    # pass, and random numbers eager dropout does not consume).
    return _fused_inference(x, bias, residual, prob)
