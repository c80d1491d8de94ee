"""Which compiled kernels run by default, per device: only those that beat the PyTorch path
(``kernels.FASTER_THAN_PYTORCH``; on CUDA ATen's layer norm and RMS norm are the faster)."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fusions import fused_layer_norm, fused_softmax, kernels


def test_cuda_runs_atens_layer_norm_and_the_softmax_kernels():
    assert kernels.preferred("layer_norm", "cuda") is None  # whatever is built
    assert "layer_norm" not in kernels.FASTER_THAN_PYTORCH["cuda"]
    # The CUDA RMS norm is built but slower than F.rms_norm at the models' shapes.
    assert kernels.preferred("rms_norm", "cuda") is None
    assert {"softmax_causal", "softmax_masked", "softmax_plain"} <= \
        kernels.FASTER_THAN_PYTORCH["cuda"]


def test_a_device_without_a_listed_kernel_takes_the_pytorch_path():
    x = torch.randn(4, 8, device="meta")
    w, b = torch.ones(8, device="meta"), torch.zeros(8, device="meta")
    assert fused_layer_norm.fused_layer_norm(x, w, b, 1e-5) is None
    assert fused_layer_norm.fused_rms_norm(x, w, 1e-5) is None
    assert fused_softmax.fused_scale_mask_softmax(torch.randn(1, 2, 4, 4, device="meta"), None,
                                                  True, 1.0) is None


def test_the_cpu_keeps_its_kernels_where_built():
    if kernels.extension("cpu") is None:
        pytest.skip("megatron.fused_kernels._cpu is not built (the fallback tests cover that)")
    for name in ("layer_norm", "rms_norm", "softmax_causal", "softmax_masked", "softmax_plain"):
        assert kernels.preferred(name, "cpu") is kernels.extension("cpu")
