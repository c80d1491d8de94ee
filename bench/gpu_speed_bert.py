"""BERT training speed on one GPU: ``pretrain_bert.py``'s step against transformers'
``BertForPreTraining`` of the same shape, one process, the same batches.

    python bench/gpu_speed_bert.py [--shape bert-base|small|tiny] [--sides hf,ours]
        [--warmup N] [--steps N] [--dropout 0.0] [--ours-args "..."] [--no-check] [--json F]

Shapes: ``bert-base`` = 12 x 768, 12 heads, FFN 3072, seq 512, micro-batch 16 (bf16 on a GPU);
``small`` = 4 x 256, 4 heads, seq 128, micro-batch 8; ``tiny`` = 2 x 64, seq 32, micro-batch 4,
vocabulary 1024 (a smoke test). Vocabulary 30592 on both sides: bert-base-uncased's 30522 +
Megatron's ``[BOS]``/``[EOS]``, padded to a multiple of 128 as Megatron pads it (here
``--tokenizer-type NullTokenizer --vocab-size 30523``, whose EOD makes 30524: no vocabulary file
is needed).

Both sides train on the same ``--batches`` micro-batches, cycled in the same order: full
sequences (no padding: seq-512 BERT pretraining packs its sentences up to the length),
``[CLS] A [SEP] B [SEP]`` with the split drawn per sample, 15% of the non-special positions
predicted (80% ``[MASK]``, 10% a random id, 10% kept; 76 positions at seq 512, BERT's
``max_predictions_per_seq``), a random sentence-order label. Both compute the masked-LM loss (the
mean over the predicted positions) plus the two-way sentence loss, and take one AdamW step
(lr 1e-4, weight decay 0.01, clip 1.0) per micro-batch:

* ``hf``: ``BertForPreTraining`` from a ``BertConfig`` (``attn_implementation="sdpa"``,
  post-LN, exact GeLU), fp32 parameters under ``torch.autocast`` bf16, ``torch.optim.AdamW``
  fused (``bench/plain_gpt.py``'s); the batch moved to the device each step, as ours' loader does;
* ``ours``: ``pretrain_bert.py``'s model provider, forward step and loss with the trainer's
  ``train_step`` (``--bf16``: bf16 parameters, fp32 main weights and gradients), its defaults
  otherwise (pre-LN layers, the fused tanh bias-GeLU in the MLP: the same FLOPs as HF's). Ours
  runs its masked-LM head on the predicted positions only (``BertModel.masked_lm_loss``), HF's
  on every position: the head is part of what is compared.

Before timing, ``--check`` (default on) shows that both sides compute the same thing on these
batches: a BERT of ours with HF's arrangement (``--apply-residual-connection-post-layernorm``,
exact GeLU) has its weights copied into ``BertForPreTraining`` by ``tools/checkpoint``'s HF BERT
export, and both losses (masked LM + sentence order, fp32) of the first batch must agree.

Then HF is timed, freed, and ours is built and timed (so each side's peak memory is its own);
every step sits between two device synchronisations; figures are medians of ``--steps`` after
``--warmup``; tokens/s = micro-batch x seq / step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shlex
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
import bench_train  # noqa: E402
import gpu_speed  # noqa: E402
import plain_gpt  # noqa: E402

from megatron.core import device  # noqa: E402

CLS, SEP, MASK = 101, 102, 103  # bert-base-uncased's ids
FIRST_WORD = 104  # the words: ids after [MASK] up to the tokenizer's
MASKED_FRACTION = 0.15
BATCH_KEYS = ("text", "types", "labels", "is_random", "loss_mask", "padding_mask")


@dataclasses.dataclass
class Shape(bench_train.Shape):
    """bench_train's shape, with BERT's vocabulary."""

    null_vocab: int = 30523
    """``--vocab-size`` of ours' NullTokenizer: with its EOD 30524, bert-base-uncased's 30522
    + Megatron's [BOS]/[EOS]."""

    @property
    def vocab(self) -> int:
        """The padded vocabulary of both sides (Megatron's: a multiple of 128)."""
        return -(-(self.null_vocab + 1) // 128) * 128


SHAPES = {
    "bert-base": Shape("bert-base", 12, 768, 12, 512, 16, warmup=5, steps=20),
    "small": Shape("small", 4, 256, 4, 128, 8, warmup=2, steps=5),
    # A smoke test: seconds on a CPU (a 1024-entry vocabulary: the logits and embeddings small).
    "tiny": Shape("tiny", 2, 64, 4, 32, 4, warmup=1, steps=2, null_vocab=1000),
}


# Batches ----------------------------------------------------------------------------------------
def make_batch(shape: Shape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One micro-batch in pretrain_bert.py's format (CPU tensors, as its loader yields them):
    ``text``, ``types``, ``labels`` (-1 where not predicted), ``is_random``, ``loss_mask``,
    ``padding_mask`` (all ones: full sequences)."""
    b, s = shape.mb, shape.seq
    words = (FIRST_WORD, shape.null_vocab)
    original = torch.randint(*words, (b, s), generator=gen, device="cpu")  # [b, s]
    original[:, 0] = CLS
    original[:, -1] = SEP
    split = torch.randint(s // 4, 3 * s // 4, (b,), generator=gen, device="cpu")  # A's [SEP]
    rows = torch.arange(b, device="cpu")
    original[rows, split] = SEP
    positions = torch.arange(s, device="cpu").unsqueeze(0)  # [1, s]
    types = (positions > split.unsqueeze(1)).long()  # [b, s]: 0 up to A's [SEP], 1 after
    special = (original == CLS) | (original == SEP)
    n_predicted = max(1, round(MASKED_FRACTION * (s - 3)))
    # n_predicted of each row's ordinary positions, uniformly: the smallest random keys.
    keys = torch.rand((b, s), generator=gen, device="cpu").masked_fill(special, 2.0)
    chosen = keys.argsort(dim=1)[:, :n_predicted]  # [b, n_predicted]
    loss_mask = torch.zeros((b, s), dtype=torch.long, device="cpu").scatter_(1, chosen, 1)
    labels = torch.where(loss_mask.bool(), original, torch.full_like(original, -1))
    # 80% [MASK], 10% a random id, 10% the token itself.
    draw = torch.rand((b, s), generator=gen, device="cpu")
    replacement = torch.randint(*words, (b, s), generator=gen, device="cpu")
    text = torch.where(loss_mask.bool() & (draw < 0.8), torch.full_like(original, MASK),
                       original)
    text = torch.where(loss_mask.bool() & (draw >= 0.8) & (draw < 0.9), replacement, text)
    return {"text": text, "types": types, "labels": labels,
            "is_random": torch.randint(0, 2, (b,), generator=gen, device="cpu"),
            "loss_mask": loss_mask, "padding_mask": torch.ones_like(text)}


def make_batches(shape: Shape, count: int, seed: int = 1234) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [make_batch(shape, gen) for _ in range(count)]


def hf_inputs(batch: dict[str, torch.Tensor], dev: torch.device) -> dict[str, torch.Tensor]:
    """``BertForPreTraining``'s keyword arguments for one of our batches, on ``dev``."""
    on = {key: batch[key].to(dev, non_blocking=True) for key in BATCH_KEYS}
    return {"input_ids": on["text"], "token_type_ids": on["types"],
            "attention_mask": on["padding_mask"],
            "labels": on["labels"].masked_fill(on["loss_mask"] == 0, -100),
            "next_sentence_label": on["is_random"]}


# HF -------------------------------------------------------------------------------------------
def hf_config(shape: Shape, dropout: float, hidden_act: str = "gelu", eps: float = 1e-12):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.BertConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, intermediate_size=4 * shape.hidden,
        max_position_embeddings=shape.seq, type_vocab_size=2, hidden_act=hidden_act,
        layer_norm_eps=eps, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        attn_implementation="sdpa")


def hf_side(shape: Shape, batches: list, bf16: bool, dropout: float,
            losses: list[float]) -> gpu_speed.Side:
    import transformers

    dev = device.get_device()
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(hf_config(shape, dropout)).to(dev)
    model.train()
    opt = plain_gpt.configure_adamw(model)
    n_params = sum(p.numel() for p in model.parameters()) - \
        model.bert.embeddings.position_embeddings.weight.numel()
    stream = itertools.cycle(batches)

    def step():
        inputs = hf_inputs(next(stream), dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    return gpu_speed.Side(step, n_params)


# Ours -----------------------------------------------------------------------------------------
def ours_flags(shape: Shape, bf16: bool, dropout: float, extra: list[str]) -> list[str]:
    flags = ["--num-layers", str(shape.layers), "--hidden-size", str(shape.hidden),
             "--num-attention-heads", str(shape.heads), "--seq-length", str(shape.seq),
             "--max-position-embeddings", str(shape.seq),
             "--micro-batch-size", str(shape.mb), "--global-batch-size", str(shape.mb),
             "--lr", "1e-4", "--weight-decay", "0.01", "--clip-grad", "1.0",
             "--train-iters", "100000", "--eval-iters", "0", "--log-interval", "1",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", str(shape.null_vocab),
             "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout),
             "--distributed-backend", device.default_backend()]
    return [*flags, *(["--bf16"] if bf16 else []), *extra]


def initialize(shape: Shape, bf16: bool, dropout: float, extra: list[str]):
    from megatron.training.initialize import initialize_megatron

    cfg = initialize_megatron(ours_flags(shape, bf16, dropout, extra), require_train_length=True)
    if cfg.padded_vocab_size != shape.vocab:
        raise SystemExit(f"ours' padded vocabulary is {cfg.padded_vocab_size}, not "
                         f"{shape.vocab} as HF's: drop the vocabulary flags from --ours-args")
    return cfg


def ours_side(cfg, batches: list, losses: list[float]) -> gpu_speed.Side:
    """pretrain_bert.py's model, optimizer and forward step with the trainer's train_step, fed
    ``batches`` in turn (its loader's format)."""
    import pretrain_bert
    from megatron.core.timers import Timers
    from megatron.training.loop import train_step
    from megatron.training.pretrain import build_microbatch_calculator, setup_model_and_optimizer

    timers = Timers(0, "minmax")
    model, optimizer, scheduler, state = setup_model_and_optimizer(
        cfg, pretrain_bert.model_provider, timers)
    microbatches = build_microbatch_calculator(cfg)
    for chunk in model:
        chunk.train()
    stream = itertools.cycle(batches)
    n_params = sum(p.numel() for chunk in model for name, p in chunk.named_parameters()
                   if "position_embeddings" not in name)

    def step():
        state.iteration += 1
        reduced, *_ = train_step(pretrain_bert.forward_step, stream, model, optimizer,
                                 scheduler, cfg, microbatches, timers,
                                 iteration=state.iteration)
        losses.append(float(sum(reduced.values())))

    return gpu_speed.Side(step, n_params)


# The check: same batches, same function -------------------------------------------------------
def same_function_losses(cfg, batch: dict[str, torch.Tensor]
                         ) -> dict[str, tuple[float, float]]:
    """``{"lm": (ours, HF), "sop": (ours, HF)}``: the masked-LM and sentence-order losses of
    ``batch`` (fp32, no dropout) for one BERT held by both sides: ours built with HF's
    arrangement, its weights copied by tools/checkpoint's BERT export into
    ``BertForPreTraining``. The word embedding (the tied output layer), the pooler and the
    sentence-order head are scaled to std 0.5 so that both heads' logits are far from uniform:
    a label, position or sentence-order mix-up then moves the losses by far more than rounding
    does (the body is unchanged: the post-LN arrangement normalises the embeddings first)."""
    import transformers

    import pretrain_bert
    from megatron.core.models.bert import BertModel
    from megatron.core.models.builder import build_model_stage
    from megatron.training.models import bert_transformer_config
    from tools.checkpoint import hf_bert

    dev = device.get_device()
    config = dataclasses.replace(
        bert_transformer_config(cfg), apply_residual_connection_post_layernorm=True,
        bias_gelu_fusion=False, params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0)
    torch.manual_seed(1)
    ours = build_model_stage(BertModel, config, add_binary_head=True).to(dev).eval()
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if name in ("language_model.embedding.word_embeddings.weight",
                        "language_model.pooler.dense.weight", "binary_head.weight"):
                param.mul_(0.5 / config.init_method_std)
    md = _Described(ours.state_dict(), argparse.Namespace(
        **dataclasses.asdict(config), bert_binary_head=True))
    vocab = cfg.padded_vocab_size
    hf = transformers.BertForPreTraining(hf_bert.bert_config(md, vocab, hf_bert.POST_LN))
    missing, unexpected = hf.load_state_dict(dict(hf_bert.bert_tensors(md, vocab,
                                                                       hf_bert.POST_LN)),
                                             strict=False)
    untouched = [k for k in missing if not k.startswith("cls.predictions.decoder")]
    if untouched or unexpected:
        raise SystemExit(f"weight copy: missing {untouched}, unexpected {unexpected}")
    hf = hf.to(dev).eval()
    with torch.no_grad():
        output, loss_fn = pretrain_bert.forward_step(iter([batch]), ours)
        ours_losses = loss_fn(output)[1]
        inputs = hf_inputs(batch, dev)
        hf_out = hf(**inputs)
        # HF's loss is the masked-LM mean plus the next-sentence cross entropy.
        hf_sop = float(torch.nn.functional.cross_entropy(hf_out.seq_relationship_logits,
                                                         inputs["next_sentence_label"]))
        hf_lm = float(hf_out.loss) - hf_sop
    del ours, hf
    device.empty_cache()
    return {"lm": (float(ours_losses["lm loss"]), hf_lm),
            "sop": (float(ours_losses["sop loss"]), hf_sop)}


class _Described:
    """A model's state dict as tools/checkpoint's ModelDescription pieces (what the HF export
    reads): embeddings, layer ``i``, head."""

    family = "BERT"

    def __init__(self, state: dict[str, torch.Tensor], args: argparse.Namespace) -> None:
        self.state, self.args = state, args
        self.num_layers = int(args.num_layers)

    def embeddings(self) -> dict[str, torch.Tensor]:
        return self._under("language_model.embedding.")

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        return self._under(f"language_model.encoder.layers.{index}.")

    def head(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state.items()
                if not k.startswith(("language_model.embedding.",
                                     "language_model.encoder.layers."))}

    def _under(self, prefix: str) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state.items() if k.startswith(prefix)}


def check_same_function(cfg, batch: dict[str, torch.Tensor]) -> dict:
    """Print both sides' losses of the same BERT on ``batch``; exit unless they agree (fp32:
    a relative 1e-4 leaves room for the two attention kernels' summation orders only)."""
    losses = same_function_losses(cfg, batch)
    diff = max(abs(o - h) / max(1.0, abs(h)) for o, h in losses.values())
    print("check: same batch, same weights (post-LN, exact GeLU, fp32): " + ", ".join(
        f"{name} loss ours {o:.5f} vs HF {h:.5f}" for name, (o, h) in losses.items())
        + f" (largest relative diff {diff:.1e})", flush=True)
    if diff > 1e-4:
        raise SystemExit("check FAILED: the two sides do not compute the same losses")
    return {**{f"{name}_{side}": v for name, pair in losses.items()
               for side, v in zip(("ours", "hf"), pair)}, "diff": diff}


# Main -----------------------------------------------------------------------------------------
def report(shape: Shape, name: str, res: dict, losses: list[float]) -> str:
    peak = "-" if res["peak_GiB"] is None else f"{res['peak_GiB']:.2f}"
    return (f"{shape.name} {name}: {res['ms']:.1f} ms/step, {res['tokens_per_s'] / 1e3:.1f}k "
            f"tokens/s, peak {peak} GiB, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
            f"first step {res['first_step_s']:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="bert-base", choices=sorted(SHAPES))
    parser.add_argument("--sides", default="hf,ours")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batches", type=int, default=8, help="distinct batches, cycled")
    parser.add_argument("--dropout", type=float, default=0.0, help="both sides' dropout")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                        help="default: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--ours-args", default="", help="extra pretrain_bert.py flags for ours")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the same-function loss check before timing")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    sides = [s for s in args.sides.split(",") if s]
    if set(sides) - {"hf", "ours"}:
        parser.error(f"--sides: unknown {sorted(set(sides) - {'hf', 'ours'})}")
    warmup = args.warmup if args.warmup is not None else shape.warmup
    steps = args.steps if args.steps is not None else shape.steps
    precision = args.precision or ("bf16" if device.accelerator_available() else "fp32")
    bf16 = precision == "bf16"
    print(f"# {shape}; {precision}; device {device.get_device()}; load {bench_train.load()}",
          flush=True)
    cfg = initialize(shape, bf16, args.dropout, shlex.split(args.ours_args))
    batches = make_batches(shape, args.batches)
    predicted = int(batches[0]["loss_mask"].sum()) // shape.mb
    print(f"# {shape.mb} x {shape.seq} tokens per step, {predicted} predicted per sample "
          f"({predicted / shape.seq:.1%} of the positions), no padding", flush=True)
    out = {"shape": dataclasses.asdict(shape), "precision": precision, "results": {}}
    if not args.no_check:
        out["check"] = check_same_function(cfg, batches[0])
    tokens = shape.mb * shape.seq
    for name in sides:
        losses: list[float] = []
        side = hf_side(shape, batches, bf16, args.dropout, losses) if name == "hf" \
            else ours_side(cfg, batches, losses)
        res = gpu_speed.time_side(side, warmup, steps)
        res["tokens_per_s"] = tokens / (res["ms"] / 1000)
        res["first_loss"], res["last_loss"] = losses[0], losses[-1]
        out["results"][name] = res
        print(report(shape, name, res, losses), flush=True)
        gpu_speed.release(side)
        del side
    if {"hf", "ours"} <= set(out["results"]):
        ratio = out["results"]["hf"]["ms"] / out["results"]["ours"]["ms"]
        print(f"{shape.name} ours/HF speed: {ratio:.2f}x", flush=True)
    print(f"# load at end {bench_train.load()}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # the process group: nothing left to tear down gracefully


if __name__ == "__main__":
    main()
