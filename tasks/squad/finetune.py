"""``--task SQUAD``: finetune BERT's span head on SQuAD 1.1 / 2.0 (Google's ``run_squad.py``
recipe on :func:`tasks.finetune_utils.finetune`); the official EM/F1 on every ``--valid-data``
file at each epoch end, and ``predictions.json`` (+ ``null_odds.json`` for 2.0).

    torchrun --nproc-per-node 2 tasks/main.py --task SQUAD --squad-version 2.0 \
        --train-data train-v2.0.json --valid-data dev-v2.0.json \
        --pretrained-checkpoint bert-345m/ --epochs 2 --seq-length 384 --doc-stride 128 \
        --tokenizer-type BertWordPieceLowerCase --vocab-file bert-vocab.txt ...

Every rank reads and featurizes the files itself, before process groups start (a malformed
file ends the run with one line naming it). Evaluation: each data-parallel rank runs its share
of the dev features (through the forward-only schedule: at any pipeline size), the last
stage's logits are summed over the data-parallel group into one ``[features, s, 2]`` array and
handed to every stage, and every rank postprocesses them (so every rank returns the same
metrics); the last rank logs and writes the files.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

from megatron.core import comm
from megatron.core.log import log_rank_0, log_rank_last
from megatron.tokenizer.config import BERT_TOKENIZERS
from tasks.eval_utils import forward_outputs, share_from_last_stage
from tasks.finetune_loaders import evaluation_loader
from tasks.finetune_utils import finetune
from tasks.flags import TaskFlags
from tasks.squad import metric
from tasks.squad.features import SquadFeature, convert_examples_to_features
from tasks.squad.flags import SquadFlags, check_squad_flags
from tasks.squad.model import span_forward_step, squad_model_provider
from tasks.squad.postprocess import compute_predictions, write_predictions
from tasks.squad.reader import SquadExample, SquadFile, read_squad_examples


class SquadFeatureDataset(torch.utils.data.Dataset):
    """Features padded to ``seq_length``: items ``text``, ``types``, ``padding_mask`` [s] and
    ``start``, ``end`` (the labels; 0 when read for evaluation), ``index`` (the feature's)."""

    def __init__(self, features: list[SquadFeature], seq_length: int, pad_id: int) -> None:
        n = len(features)
        self.text = np.full((n, seq_length), pad_id, dtype=np.int32)
        self.types = np.zeros((n, seq_length), dtype=np.int8)
        self.lengths = np.zeros(n, dtype=np.int32)
        self.labels = np.zeros((n, 2), dtype=np.int64)
        for i, f in enumerate(features):
            length = len(f.input_ids)
            self.text[i, :length] = f.input_ids
            self.types[i, f.doc_offset:length] = 1
            self.lengths[i] = length
            self.labels[i] = (f.start_position or 0, f.end_position or 0)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict:
        seq = self.text.shape[1]
        return {"text": self.text[index].astype(np.int64),
                "types": self.types[index].astype(np.int64),
                "padding_mask": (np.arange(seq) < self.lengths[index]).astype(np.int64),
                "start": self.labels[index, 0], "end": self.labels[index, 1], "index": index}


@dataclasses.dataclass
class EvalSet:
    """One ``--valid-data`` file: its examples, features and the raw data for the metric."""

    name: str
    file: SquadFile
    features: list[SquadFeature]
    dataset: SquadFeatureDataset


def dataset_name(path: str) -> str:
    """``dev-v2.0`` for ``.../dev-v2.0.json``."""
    return os.path.splitext(os.path.basename(os.path.normpath(path)))[0]


def _featurize(examples: list[SquadExample], tokenizer, cfg, is_training: bool):
    sq = cfg.section(SquadFlags)
    return convert_examples_to_features(examples, tokenizer, cfg.data.seq_length, sq.doc_stride,
                                        sq.max_query_length, is_training)


def train_valid_datasets(cfg, tokenizer):
    """``finetune``'s data provider: every ``--train-data`` file's training features; no
    validation-loss set (SQuAD is scored by EM/F1 in the evaluation callback)."""
    sq, ex = cfg.section(SquadFlags), cfg.section(TaskFlags)
    examples, skipped = [], 0
    for path in ex.train_data:
        read = read_squad_examples(path, sq.squad_version, is_training=True)
        examples += read.examples
        skipped += len(read.skipped)
    features = _featurize(examples, tokenizer, cfg, is_training=True)
    log_rank_0(f" > SQuAD {sq.squad_version} training: {len(examples)} questions "
               f"({skipped} skipped: answer not in the document words), {len(features)} "
               f"features of {cfg.data.seq_length} tokens")
    return SquadFeatureDataset(features, cfg.data.seq_length, tokenizer.pad), None


def read_eval_set(path: str, cfg, tokenizer) -> EvalSet:
    read = read_squad_examples(path, cfg.section(SquadFlags).squad_version, is_training=False)
    features = _featurize(read.examples, tokenizer, cfg, is_training=False)
    log_rank_0(f" > {path}: {len(read.examples)} questions, {len(features)} features")
    return EvalSet(dataset_name(path), read, features,
                   SquadFeatureDataset(features, cfg.data.seq_length, tokenizer.pad))


def predict_logits(model: list[torch.nn.Module], dataset: SquadFeatureDataset,
                   micro_batch_size: int) -> np.ndarray:
    """``[features, s, 2]`` start/end logits of every feature, on every rank: each
    data-parallel rank runs its share through the forward-only schedule, the last pipeline
    stage's shares are summed over its data-parallel group (each feature is some rank's only)
    and handed to every stage."""
    seq = dataset.text.shape[1]
    logits = torch.zeros(len(dataset), seq, 2, dtype=torch.float32, device="cpu")  # host
    for out, batch in forward_outputs(model, evaluation_loader(dataset, micro_batch_size)):
        logits[batch["index"].cpu()] = out.float().cpu()
    return share_from_last_stage(logits).cpu().numpy()


def _is_last_rank() -> bool:
    world = comm.world_group()
    return comm.rank(world) == comm.world_size(world) - 1


def _output_dir(cfg, name: str, epoch: int) -> str | None:
    base = cfg.section(SquadFlags).predictions_dir
    if base is None and cfg.checkpoint.save is not None:
        base = os.path.join(cfg.checkpoint.save, "squad_predictions")
    if base is None:
        return None
    return os.path.join(base, name, f"epoch_{epoch + 1}" if epoch >= 0 else "evaluation_only")


def evaluate_set(model, ev: EvalSet, cfg, tokenizer, epoch: int) -> dict[str, float]:
    """EM/F1 (official definitions) of the model on one eval set; writes its files."""
    sq, ex = cfg.section(SquadFlags), cfg.section(TaskFlags)
    logits = predict_logits(model, ev.dataset,
                            ex.eval_micro_batch_size or cfg.training.micro_batch_size)
    results = {f.unique_id: (logits[i, :, 0], logits[i, :, 1]) for i, f in enumerate(ev.features)}
    preds = compute_predictions(
        ev.file.examples, ev.features, results, n_best_size=sq.n_best_size,
        max_answer_length=sq.max_answer_length, version_2=sq.squad_version == "2.0",
        null_score_diff_threshold=sq.null_score_diff_threshold, inv_vocab=tokenizer.inv_vocab,
        lower_case=getattr(tokenizer, "lower_case", True))
    scores = metric.evaluate(ev.file.dataset, preds.predictions, sq.squad_version,
                             preds.null_odds)
    out_dir = _output_dir(cfg, ev.name, epoch)
    if out_dir is not None and _is_last_rank():
        paths = write_predictions(preds, out_dir, nbest=sq.write_nbest)
        log_rank_last(f" > |epoch: {epoch}| wrote {', '.join(sorted(paths.values()))}")
    shown = ", ".join(f"{k} = {v:.4f}" if isinstance(v, float) else f"{k} = {v}"
                      for k, v in scores.items())
    log_rank_last(f" > |epoch: {epoch}| metrics for {ev.name}: {shown}")
    return scores


def metrics_provider(cfg, tokenizer):
    """``finetune``'s callback provider (None without ``--valid-data``): reads every
    ``--valid-data`` file now (before process groups); the callback returns ``f1`` and
    ``exact`` of the first file first (``f1`` ranks the epochs), then every file's scores as
    ``NAME key``."""
    eval_sets = [read_eval_set(path, cfg, tokenizer)
                 for path in cfg.section(TaskFlags).valid_data or ()]
    if not eval_sets:
        return None  # no --valid-data: training only (the summary says no evaluation ran)

    def callback(model, epoch: int) -> dict[str, float]:
        log_rank_last("calculating metrics ...")
        out: dict[str, float] = {}
        for ev in eval_sets:
            scores = evaluate_set(model, ev, cfg, tokenizer, epoch)
            if not out:
                out["f1"] = scores["f1"]
                out["exact"] = scores.get("exact", scores.get("exact_match"))
            out.update({f"{ev.name} {k}": float(v) for k, v in scores.items()})
        return out

    return callback


def check_squad_run(flags) -> None:
    """The SQuAD flags, before anything is read or started.

    Raises:
        ValueError: a recipe flag out of range, or a tokenizer other than BERT's WordPiece.
    """
    check_squad_flags(flags.section(SquadFlags), flags.data.seq_length)
    kind = flags.tokenizer.tokenizer_type
    if kind not in BERT_TOKENIZERS:
        raise ValueError(f"--task SQUAD splits documents into words and WordPiece sub-tokens: "
                         f"use --tokenizer-type {' or '.join(BERT_TOKENIZERS)}, not {kind}")


def run_squad(argv: list[str]):
    """``--task SQUAD``: finetune (or with ``--epochs 0`` evaluate); returns the
    :class:`~tasks.finetune_utils.FinetuneResult`."""
    return finetune(train_valid_datasets, squad_model_provider, span_forward_step,
                    end_of_epoch_callback_provider=metrics_provider, argv=argv, task="SQUAD",
                    check_flags=check_squad_run)
