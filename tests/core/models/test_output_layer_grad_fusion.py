"""The logits projection (the output layer, tied or not) adds its weight gradient straight into
``weight.main_grad`` with ``--gradient-accumulation-fusion``, as every other linear does: no
separate ``.grad`` of the largest weight and no add per micro-batch."""

from __future__ import annotations

import pytest
import torch

from megatron.core.models.language_model import parallel_lm_logits


@pytest.mark.parametrize("fusion", [True, False])
def test_logits_weight_gradient_goes_into_main_grad(fusion):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(12, 8, generator=gen, dtype=torch.float64))
    weight.main_grad = torch.ones_like(weight)  # what the DDP buffer gives a parameter
    grad = torch.randn(5, 2, 12, generator=gen, dtype=torch.float64)
    parallel_lm_logits(hidden, weight, None,
                       gradient_accumulation_fusion=fusion).backward(grad)
    expected = grad.reshape(-1, 12).t() @ hidden.detach().reshape(-1, 8)
    if fusion:
        assert weight.grad is None
        torch.testing.assert_close(weight.main_grad, 1 + expected)
    else:
        torch.testing.assert_close(weight.grad, expected)
        assert torch.equal(weight.main_grad, torch.ones_like(weight))
    torch.testing.assert_close(hidden.grad, grad @ weight.detach())
