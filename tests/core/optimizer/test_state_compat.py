"""Optimizer states Megatron-LM writes load into ours (no processes).

Megatron-LM trains with apex ``FusedAdam``: ``step`` lives in each param group, not in each
parameter's state, and the groups lack torch's options. Loading such a state into torch's AdamW
raised ``KeyError: 'step'``; now the group's step fills the per-parameter one, and training goes
on exactly as if the torch state had been loaded. ``reload_model_params`` of the fp32 optimizer
is a no-op (its main params are the model params).
"""

from __future__ import annotations

import copy as copy_module

import pytest
import torch

from megatron.core.optimizer import FP32Optimizer
from megatron.core.optimizer.optimizer import adapt_torch_state_dict


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    groups = [{"params": [model[0].weight, model[1].weight], "wd_mult": 1.0, "lr_mult": 1.0},
              {"params": [model[0].bias, model[1].bias], "wd_mult": 0.0, "lr_mult": 1.0,
               "weight_decay": 0.0}]
    inner = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    opt = FP32Optimizer(inner, clip_grad=0.0, log_num_zeros_in_grad=False, grad_scaler=None,
                        mp_group=None, tensor_model_parallel_rank=0)
    return model, opt


def _train(model, opt, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(5, 4, generator=gen)
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        assert opt.step()[0]


def _as_fused_adam(sd: dict) -> dict:
    (step,) = {int(s["step"]) for s in sd["state"].values()}
    return {"state": {i: {"exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]}
                      for i, s in sd["state"].items()},
            "param_groups": [{"params": g["params"], "lr": g["lr"], "bias_correction": True,
                              "betas": g["betas"], "eps": g["eps"],
                              "weight_decay": g["weight_decay"], "wd_mult": g["wd_mult"],
                              "lr_mult": g["lr_mult"], "step": step}
                             for g in sd["param_groups"]]}


def test_fused_adam_state_loads_and_continues_exactly():
    model, opt = _model_and_optimizer(0)
    _train(model, opt, 3)
    fused = copy_module.deepcopy(_as_fused_adam(opt.state_dict()))  # no shared moments
    copy, copy_opt = _model_and_optimizer(1)
    copy.load_state_dict(model.state_dict())
    with pytest.raises(KeyError, match="step"):  # what loading it unaided does
        _model_and_optimizer(2)[1].optimizer.load_state_dict(fused)
    copy_opt.reload_model_params()  # a no-op in fp32
    copy_opt.load_state_dict(fused)
    for group, mine in zip(copy_opt.param_groups, opt.param_groups):
        assert group["decoupled_weight_decay"] and group["fused"] == mine["fused"]
    _train(model, opt, 2, first=3)
    _train(copy, copy_opt, 2, first=3)
    for a, b in zip(model.parameters(), copy.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_adapt_keeps_per_parameter_steps_and_does_not_mutate_the_input():
    _, opt = _model_and_optimizer(0)
    saved = {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(3, 4)},
                       1: {"exp_avg": torch.zeros(2, 3)}},
             "param_groups": [{"params": [0, 1], "step": 5, "lr": 0.5}, {"params": [2, 3]}]}
    out = adapt_torch_state_dict(opt.optimizer, saved)
    assert float(out["state"][0]["step"]) == 7.0 and float(out["state"][1]["step"]) == 5.0
    assert "step" not in saved["state"][1]
    assert out["param_groups"][0]["lr"] == 0.5 and out["param_groups"][1]["lr"] == 1e-2
