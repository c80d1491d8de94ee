"""Pretrain a GPT model (Megatron-LM's pretrain_gpt.py, same flags).

    torchrun --nproc-per-node 2 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 \
        --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 16 \
        --lr 3e-4 --train-iters 100 --tokenizer-type GPT2BPETokenizer \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
        --data-path my-gpt2_text_document --split 949,50,1 ...
"""

from __future__ import annotations

import functools

import torch

from megatron.config.datasets import gpt_dataset_config
from megatron.core import comm, device, parallel_state
from megatron.core.transformer.context_parallel import get_batch_on_this_cp_rank
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.training import fault
from megatron.training.models import gpt_flops_per_sample, gpt_model_from
from megatron.training.pretrain import pretrain

_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def model_provider(cfg, pre_process: bool = True, post_process: bool = True) -> torch.nn.Module:
    """This rank's GPT stage, in the run's parameter dtype."""
    return gpt_model_from(cfg, pre_process=pre_process, post_process=post_process)


def datasets_provider(cfg, tokenizer, num_samples: list[int]):
    """GPT train/valid/test datasets (Megatron-Core GPTDataset indices)."""
    config = gpt_dataset_config(cfg.data, tokenizer, cfg.model.seed)
    return build_train_valid_test_datasets(config, num_samples)


def get_batch(data_iterator, keep_attention_mask: bool = True) -> dict[str, torch.Tensor | None]:
    """Next micro-batch on the compute device.

    Every pipeline stage reads the micro-batch, as Megatron-LM 23.06's get_batch does: the first
    stage uses the tokens and positions, the last the labels and loss mask, and every stage the
    attention mask (an explicit one, with --reset-attention-mask, masks every layer).
    With context parallelism each rank keeps its two of the 2 CP chunks of every sequence
    (tokens, labels, loss mask, position ids), as Megatron-Core's get_batch_on_this_cp_rank.
    ``keep_attention_mask`` False drops the loader's mask (it is the plain causal one): the model
    then takes its implicit causal path, as Megatron-Core's causal attention does, and neither a
    ``[b, 1, s, s]`` copy to the device nor a comparison that would wait for it is paid.
    """
    batch = next(data_iterator)
    dev = device.get_device()
    out = {key: batch[key].to(dev, non_blocking=True) if batch.get(key) is not None else None
           for key in _BATCH_KEYS if key != "attention_mask"}
    mask = batch.get("attention_mask") if keep_attention_mask else None
    out["attention_mask"] = mask.to(dev, non_blocking=True) if mask is not None else None
    return get_batch_on_this_cp_rank(out, parallel_state.get_context_parallel_world_size(),
                                     parallel_state.get_context_parallel_rank())


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean loss over unmasked tokens; the logged value is averaged over data-parallel ranks.

    With context parallelism the sum over this rank's tokens is divided by the token count of
    the whole sequences (summed over CP) and multiplied by CP, because the gradients are
    averaged over DP x CP: their sum over CP is then the gradient of the CP=1 loss.
    """
    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    local_sum = torch.sum(losses.view(-1) * loss_mask)
    cp_group = parallel_state.get_context_parallel_group()
    cp = comm.world_size(cp_group)
    if cp == 1:
        loss = local_sum / loss_mask.sum()
        reported = loss.detach().clone().view(1)
    else:
        totals = torch.stack((local_sum.detach(), loss_mask.sum()))  # [sum, count]
        comm.all_reduce(totals, cp_group)
        loss = local_sum / totals[1] * cp
        reported = (totals[0] / totals[1]).view(1)
    comm.all_reduce(reported, parallel_state.get_data_parallel_group(), op="avg")
    return loss, {"lm loss": reported}


def forward_step(data_iterator, model, cfg=None):
    """Megatron's contract: returns the model output and the function that reduces it.

    ``cfg`` (bound by ``pretrain``): without --reset-attention-mask every loader mask is the
    plain causal one, so it is dropped; without a config the mask is kept and honoured.
    """
    keep_mask = cfg is None or cfg.data.reset_attention_mask
    batch = get_batch(data_iterator, keep_attention_mask=keep_mask)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def flops_per_sample(cfg) -> float:
    """Model FLOPs of one training sample (forward + backward; recomputation not counted)."""
    return gpt_flops_per_sample(cfg)


if __name__ == "__main__":
    # Any error ends this rank at once (loader workers and all) and stops the other ranks.
    fault.run_rank(lambda: pretrain(datasets_provider, model_provider, forward_step,
                                    flops_per_sample=flops_per_sample, require_data=True))
