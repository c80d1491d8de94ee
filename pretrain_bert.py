"""Pretrain a BERT model (Megatron-LM's pretrain_bert.py, same flags): masked-LM loss over the
masked positions plus, unless --bert-no-binary-head, the sentence-order (SOP) loss.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix my-bert \
        --tokenizer-type BertWordPieceLowerCase --vocab-file bert-vocab.txt --split-sentences
    torchrun --nproc-per-node 2 pretrain_bert.py --tensor-model-parallel-size 2 \
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 \
        --max-position-embeddings 512 --micro-batch-size 8 --global-batch-size 32 \
        --lr 1e-4 --train-iters 1000 --vocab-file bert-vocab.txt \
        --data-path my-bert_text_sentence --split 949,50,1 ...

As Megatron-LM's script, ``--tokenizer-type`` defaults to ``BertWordPieceLowerCase``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from megatron.config.cli import build_parser, parse_flags
from megatron.config.datasets import bert_dataset_config
from megatron.config.validate import check_bert_flags
from megatron.core import comm, device, parallel_state
from megatron.data.bert_dataset import build_train_valid_test_datasets
from megatron.training import fault
from megatron.training.models import bert_flops_per_sample, bert_model_from
from megatron.training.pretrain import pretrain

_BATCH_KEYS = ("text", "types", "labels", "is_random", "loss_mask", "padding_mask")
DEFAULT_TOKENIZER = "BertWordPieceLowerCase"


def model_provider(cfg, pre_process: bool = True, post_process: bool = True) -> torch.nn.Module:
    """This rank's BERT stage (binary head and two token types unless --bert-no-binary-head)."""
    return bert_model_from(cfg, pre_process=pre_process, post_process=post_process)


def datasets_provider(cfg, tokenizer, num_samples: list[int]):
    """BERT train/valid/test datasets (Megatron-Core's BERTMaskedWordPieceDataset)."""
    config = bert_dataset_config(cfg.data, tokenizer, cfg.model.seed,
                                 classification_head=cfg.model.bert_binary_head)
    return build_train_valid_test_datasets(config, num_samples)


def get_batch(data_iterator) -> dict[str, torch.Tensor]:
    """Next micro-batch on the compute device, every field int64 (as Megatron's
    ``broadcast_data``) except the loss mask, which is float."""
    batch = next(data_iterator)
    dev = device.get_device()
    out = {key: torch.as_tensor(batch[key], device="cpu").to(dev, torch.long, non_blocking=True)
           for key in _BATCH_KEYS}
    out["loss_mask"] = out["loss_mask"].float()
    return out


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output_tensor):
    """Masked-LM loss averaged over the predicted positions, plus the SOP cross entropy (fp32);
    the logged values are averaged over data-parallel ranks."""
    lm_loss_, sop_logits = output_tensor
    lm_loss = torch.sum(lm_loss_.float().view(-1) * loss_mask.view(-1)) / loss_mask.sum()
    losses = [lm_loss]
    if sop_logits is not None:
        sop_loss = F.cross_entropy(sop_logits.view(-1, 2).float(), sentence_order.view(-1),
                                   ignore_index=-1)
        losses.append(sop_loss)
    reported = torch.stack([loss.detach() for loss in losses])
    comm.all_reduce(reported, parallel_state.get_data_parallel_group(), op="avg")
    names = ("lm loss", "sop loss")[:len(losses)]
    return sum(losses), {name: reported[i].view(1) for i, name in enumerate(names)}


def forward_step(data_iterator, model):
    """Megatron's contract: returns the model output and the function that reduces it."""
    batch = get_batch(data_iterator)
    # Megatron-LM: without the binary head the model has no token-type embedding.
    types = batch["types"] if _has_binary_head(model) else None
    output = model(batch["text"], batch["padding_mask"], tokentype_ids=types,
                   lm_labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"], batch["is_random"])


def _has_binary_head(model) -> bool:
    inner = getattr(model, "module", model)  # through the data-parallel wrapper
    return getattr(inner, "add_binary_head", True)


def flops_per_sample(cfg) -> float:
    """Model FLOPs of one training sample (forward + backward; recomputation not counted)."""
    return bert_flops_per_sample(cfg)


def with_default_tokenizer(argv: Sequence[str]) -> list[str]:
    """``argv`` with Megatron-LM pretrain_bert.py's ``args_defaults``: ``--tokenizer-type
    BertWordPieceLowerCase`` when a ``--vocab-file`` is given without a tokenizer type."""
    argv = list(argv)
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    if "--vocab-file" in given and "--tokenizer-type" not in given:
        argv += ["--tokenizer-type", DEFAULT_TOKENIZER]
    return argv


def check_flags(argv: Sequence[str]) -> None:
    """BERT's own flag checks (``megatron.config.validate.check_bert_flags``) before pretrain()
    starts anything; a bad flag exits 2 with the usage, as every other flag error."""
    parser = build_parser()
    try:
        check_bert_flags(parse_flags(parser, argv))
    except ValueError as err:
        parser.print_usage(sys.stderr)
        parser.exit(2, f"{parser.prog}: error: {err}\n")


def main(argv: Sequence[str]) -> None:
    argv = with_default_tokenizer(argv)
    check_flags(argv)
    pretrain(datasets_provider, model_provider, forward_step, argv=argv,
             flops_per_sample=flops_per_sample, require_data=True)


if __name__ == "__main__":
    # Any error ends this rank at once (loader workers and all) and stops the other ranks.
    fault.run_rank(lambda: main(sys.argv[1:]))
