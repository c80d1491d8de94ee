"""Helpers shared by the TP equivalence tests: re-assemble sharded tensors, compare grads."""

from __future__ import annotations

import torch

from megatron.core import comm


def gather_full(param: torch.Tensor, tensor: torch.Tensor, group) -> torch.Tensor:
    """The full tensor from every TP rank's shard (``param`` carries the TP attributes)."""
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    return torch.cat(comm.all_gather_list(tensor.contiguous(), group), dim=param.partition_dim)


def assert_same_params_and_grads(ref: torch.nn.Module, par: torch.nn.Module, group,
                                 rtol: float = 1e-7, atol: float = 1e-9) -> int:
    """Every parameter and gradient of the TP module re-assembles to the reference's."""
    ref_params = dict(ref.named_parameters())
    names = list(dict(par.named_parameters()))
    assert names == list(ref_params), (names, list(ref_params))
    for name, param in par.named_parameters():
        want = ref_params[name]
        torch.testing.assert_close(gather_full(param, param.data, group), want.data,
                                   rtol=rtol, atol=atol, msg=f"value of {name}")
        torch.testing.assert_close(gather_full(param, param.grad, group), want.grad,
                                   rtol=rtol, atol=atol, msg=f"grad of {name}")
    return len(names)
