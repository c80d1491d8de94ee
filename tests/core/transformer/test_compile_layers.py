"""``compile_layers``: what ``torch.compile`` sees of a transformer layer, and what the compiled
layers compute, below the training loop (tests/training/test_compile_layers.py trains with
inductor).

* TP=1: every layer variant (GPT with dropout, the unfused attention path with the fused
  softmax, selective recompute, a Llama-shaped layer, post-LN residual with layernorm-1p) is one
  graph: no pybind kernel, TorchScript function, RNG-state swap or custom autograd Function
  left inside. ``torch._dynamo.explain`` traces without compiling: cheap.
* TP=1 recompute with dropout: the compiled block with full or selective recompute gives the
  outputs and gradients of the compiled block without it (the recompute replays the masks).
* TP=2, with and without sequence parallelism: the compiled block equals the eager block, and
  each layer is one graph: the TP collectives are traced as functional collectives, no graph
  break; with dropout the replicated residual stream stays identical on both ranks (default
  generator in step) while attention dropout runs under the per-rank stream (the one break).

The compiled sides here use the ``aot_eager`` backend (dynamo + AOTAutograd, eager kernels):
what is under test is what our code gives the compiler, and inductor's C++ compilation would
cost tens of seconds per graph on two cores. With inductor the same recompute check was run by
hand (bit-identical outputs; gradients within 5e-13).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from megatron.core import comm, device
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer.block import TransformerBlock
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.layer import TransformerLayer
from tests.multiprocess import run_distributed

CONFIG = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                           hidden_dropout=0.1, attention_dropout=0.1, compile_layers=True)
SEQ, BATCH = 8, 2
VARIANTS = {
    "gpt": {},
    "unfused_attention": dict(attention_backend="unfused"),
    "selective_recompute": dict(recompute_granularity="selective"),
    "llama": dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  num_query_groups=2, qk_layernorm=True, position_embedding_type="rope"),
    "post_ln_1p": dict(apply_residual_connection_post_layernorm=True, apply_layernorm_1p=True),
}


def _input(*shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device.get_device())


def _cheaply_compiled(block: TransformerBlock) -> TransformerBlock:
    """The block's compiled layers, rebuilt with the ``aot_eager`` backend (module docstring)."""
    assert all(isinstance(c, torch._dynamo.eval_frame.OptimizedModule)
               for c in block.compiled_layers)
    block.compiled_layers = [torch.compile(layer, backend="aot_eager") for layer in block.layers]
    return block


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_layer_is_one_graph_at_tp1(variant):
    config = dataclasses.replace(CONFIG, **VARIANTS[variant])
    torch.manual_seed(0)
    model_parallel_manual_seed(1, 0)
    layer = TransformerLayer(config, 1, None).train()
    args = [_input(SEQ, BATCH, 32, seed=1).requires_grad_()]
    if config.position_embedding_type == "rope":
        args += [None, None, _input(SEQ, 1, 1, 8, seed=2)]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(*args)
    reasons = [b.reason.splitlines()[0] for b in explained.break_reasons]
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), reasons


def _run_block(block: TransformerBlock, x: torch.Tensor, seed: int):
    """Output, input gradient and parameter gradients of one forward and backward."""
    block.zero_grad()
    torch.manual_seed(seed)
    model_parallel_manual_seed(seed, ps.get_tensor_model_parallel_rank()
                               if ps.model_parallel_is_initialized() else 0)
    x = x.detach().requires_grad_()
    out = block(x)
    out.backward(_input(*out.shape, seed=99))
    return out.detach(), x.grad, [p.grad.clone() for p in block.parameters()]


def _max_diff(a, b) -> float:
    (out_a, x_a, grads_a), (out_b, x_b, grads_b) = a, b
    pairs = [(out_a, out_b), (x_a, x_b), *zip(grads_a, grads_b)]
    return max(float((p - q).abs().max()) for p, q in pairs)


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="selective")])
def test_recompute_replays_the_compiled_layers_dropout(recompute):
    x = _input(SEQ, BATCH, 32, seed=1)
    results = []
    for kwargs in ({}, recompute):
        torch.manual_seed(0)
        block = _cheaply_compiled(TransformerBlock(dataclasses.replace(CONFIG, **kwargs), None))
        results.append(_run_block(block.train(), x, seed=5))
    assert _max_diff(*results) <= 1e-6


def _graph_breaks() -> set[str]:
    """The functions dynamo's graph breaks since the last ``counters.clear()`` skipped."""
    return {m for reason in counters["graph_break"]
            for m in re.findall(r"function `<function (\w+)", reason)} or \
        set(counters["graph_break"])


def _tp2_checks(rank: int, world_size: int) -> dict:
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = ps.get_tensor_model_parallel_group()
    out: dict = {}
    for sp in (False, True):
        config = dataclasses.replace(CONFIG, hidden_dropout=0.0, attention_dropout=0.0,
                                     sequence_parallel=sp)
        torch.manual_seed(0)
        block = _cheaply_compiled(TransformerBlock(config, group)).train()
        x = _input(SEQ, BATCH, 32, seed=1)
        if sp:  # this rank's rows of the sequence, in storage of their own as the embedding's
            # scatter hands them over (a view at an offset would specialize the first layer's
            # graph on the offset, and the next layer's input has none)
            x = x.chunk(world_size)[rank].clone()
        counters.clear()
        compiled = _run_block(block, x, seed=5)
        out[f"sp={sp} breaks"] = _graph_breaks()
        out[f"sp={sp} graphs"] = counters["stats"]["unique_graphs"]
        block.compiled_layers = None
        out[f"sp={sp} diff"] = _max_diff(_run_block(block, x, seed=5), compiled)
    # Dropout on: the replicated residual stream must stay identical on the two ranks.
    torch.manual_seed(0)
    config = dataclasses.replace(CONFIG, hidden_dropout=0.5, attention_dropout=0.5)
    block = _cheaply_compiled(TransformerBlock(config, group)).train()
    counters.clear()
    y, _, _ = _run_block(block, _input(SEQ, BATCH, 32, seed=1), seed=5)
    out["dropout breaks"] = _graph_breaks()
    outs = comm.all_gather_list(y, group)
    states = comm.all_gather_list(torch.get_rng_state().double(), group)
    out["replicated output equal"] = torch.equal(outs[0], outs[1])
    out["default generator in step"] = torch.equal(states[0], states[1])
    ps.destroy_model_parallel()
    return out


def test_compiled_layers_at_tp2_trace_the_collectives():
    results = run_distributed(2, _tp2_checks, timeout=300)
    for rank, res in enumerate(results):
        for sp in (False, True):
            assert res[f"sp={sp} diff"] <= 1e-6, (rank, sp, res)
            # The collectives are traced (tensor_parallel.mappings): a layer is one graph, and
            # the layers (the same code, their parameters graph inputs) share it.
            assert res[f"sp={sp} breaks"] == set(), res
            assert res[f"sp={sp} graphs"] == 1, res
        # With dropout, the attention core under the per-rank stream runs eagerly.
        assert res["dropout breaks"] == {"_forked_eagerly"}, res
        assert res["replicated output equal"] and res["default generator in step"], res
