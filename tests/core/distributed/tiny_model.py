"""A tiny tied-embedding language model and a training loop, shared by the DDP/optimizer tests."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from megatron.core import comm
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                        TorchDistributedDataParallel,
                                        finalize_model_grads)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

VOCAB, HIDDEN, SEQ = 16, 8, 4


class TinyLM(torch.nn.Module):
    """Embedding -> Linear -> LayerNorm -> GELU -> Linear -> tied output layer (592 params)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, HIDDEN)
        self.fc1 = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.norm = torch.nn.LayerNorm(3 * HIDDEN)
        self.fc2 = torch.nn.Linear(3 * HIDDEN, HIDDEN)
        for param in self.parameters():
            param.tensor_model_parallel = False
        self.embedding.weight.tensor_model_parallel = True
        self.embedding.weight.partition_dim = 0

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)                          # [b, s, h]
        h = self.fc2(F.gelu(self.norm(self.fc1(h))))        # [b, s, h]
        logits = h @ self.embedding.weight.t()              # [b, s, v] (tied weight)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (size, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def build(dp_group, mp_group, *, dtype=torch.float32, distopt=False, overlap=False,
          bucket_size=None, accumulate=None, precision=None, clip=1.0, optimizer="adam",
          seed=0, lr=1e-2, ddp_impl="local", contiguous=True):
    """A DDP-wrapped TinyLM and its Megatron optimizer."""
    torch.manual_seed(seed)
    model = TinyLM().to(dtype)
    if accumulate is None:
        accumulate = dtype == torch.bfloat16
    if ddp_impl == "torch":
        ddp = TorchDistributedDataParallel(model, dp_group=dp_group)
    else:
        config = DistributedDataParallelConfig(
            accumulate_allreduce_grads_in_fp32=accumulate, overlap_grad_reduce=overlap,
            use_distributed_optimizer=distopt, use_contiguous_buffers_in_local_ddp=contiguous)
        ddp = DistributedDataParallel(model, config, dp_group=dp_group, bucket_size=bucket_size)
    precision = precision or dict(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    config = OptimizerConfig(lr=lr, clip_grad=clip, weight_decay=0.1, optimizer=optimizer,
                             params_dtype=dtype, use_distributed_optimizer=distopt, **precision)
    opt = get_megatron_optimizer(config, [ddp], dp_group=dp_group, mp_group=mp_group,
                                 tensor_model_parallel_rank=0)
    return ddp, opt


def train(ddp, opt, steps, dp_group, micro_batches=2, micro_batch_size=2, first_step=0,
          before_step=None, after_backward=None):
    """Run ``steps`` iterations; returns the DP-averaged losses and the step results."""
    dp_size, dp_rank = comm.world_size(dp_group), comm.rank(dp_group)
    losses, results = [], []
    for step in range(first_step, first_step + steps):
        tokens, labels = global_batch(step, dp_size * micro_batches * micro_batch_size)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        total = torch.zeros(1)
        for micro in range(micro_batches):
            start = (dp_rank * micro_batches + micro) * micro_batch_size
            span = slice(start, start + micro_batch_size)
            last = micro == micro_batches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = ddp(tokens[span], labels[span]) / micro_batches
                opt.scale_loss(loss).backward()
            if after_backward is not None:
                after_backward(last, ddp)
            total += loss.detach().float()
        finalize_model_grads([ddp])
        if before_step is not None:
            before_step(step, ddp)
        results.append(opt.step())
        comm.all_reduce(total, dp_group, "avg")
        losses.append(total.item())
    return losses, results


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x.detach().float() - y.detach().float()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters()))
