"""A TP = 2 checkpoint saved by the real training path merges, with megatron.checkpointing
alone (no process group in this process), into exactly the TP = 1 model.

Both checkpoints come from ``pretrain()`` (pooled worlds of 2 and 1 ranks), tied embeddings
with biases and untied without; trained one step at learning rate 0, so their weights are the
initial ones, which are the same for every TP size (each TP rank keeps its slice of the full
weight drawn from one seed): the merged TP = 2 shards must equal the TP = 1 weights bit for bit.
The other way, the layout's split of the TP = 1 weights gives the TP = 2 shards as saved.
"""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing import (GPT_LAYOUT, PipelineStages, flatten_model_state,
                                    latest_checkpoint_dir, load_checkpoint_file, nest_model_state,
                                    shard_files)
from tests.training import e2e

SHAPE = {"iters": 1, "lr": 0.0, "seq": 16, "mbs": 1, "gbs": 2}
VARIANTS = {"tied": [],
            "untied_no_bias": ["--untie-embeddings-and-output-weights", "--disable-bias-linear"]}


@pytest.fixture(scope="module")
def saved(gpt2_corpus, tmp_path_factory):
    base = tmp_path_factory.mktemp("tp_merge")
    roots = {(tp, name): base / f"tp{tp}_{name}" for tp in (1, 2) for name in VARIANTS}
    for tp in (2, 1):
        results = e2e.pooled(tp, [
            {"argv": e2e.gpt_argv(gpt2_corpus, tp=tp, **SHAPE,
                                  extra=[*flags, "--lr-warmup-iters", "0",
                                         "--save", roots[(tp, name)], "--save-interval", "1"])}
            for name, flags in VARIANTS.items()])
        assert [r["error"] for run in results for r in run] == [None] * tp * len(VARIANTS)
    return roots


def _read_shards(root) -> tuple[dict, dict[tuple[int, int], dict]]:
    """(args, {(tp rank, pp rank): loaded model_optim_rng.pt}) of the latest checkpoint."""
    shards = {ranks: load_checkpoint_file(path)
              for ranks, path in shard_files(latest_checkpoint_dir(root)).items()}
    return shards[(0, 0)]["args"], shards


def _merged(root) -> dict[str, torch.Tensor]:
    """The whole model of a checkpoint: every chunk's TP shards merged, then the stages."""
    args, shards = _read_shards(root)
    tp = args.tensor_model_parallel_size
    stages = PipelineStages(args.num_layers, args.pipeline_model_parallel_size)
    assert sorted(shards) == [(t, p) for t in range(tp)
                              for p in range(args.pipeline_model_parallel_size)]
    chunks = [GPT_LAYOUT.merge_tensor_parallel(
        [flatten_model_state(shards[(t, chunk.pipeline_rank)][chunk.model_key])
         for t in range(tp)]) for chunk in stages.chunks()]
    return GPT_LAYOUT.merge_pipeline(chunks, stages)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_shards_merge_into_the_tp1_model(saved, variant):
    assert not torch.distributed.is_initialized()
    args, shards = _read_shards(saved[(2, variant)])
    assert args.tensor_model_parallel_size == 2 and len(shards) == 2
    full = _merged(saved[(1, variant)])
    merged = _merged(saved[(2, variant)])
    assert list(merged) == list(full)
    for key, value in full.items():
        assert merged[key].dtype == value.dtype and torch.equal(merged[key], value), key
    # Not vacuous: the shards really are halves of some tensors (and whole copies of others).
    shard = flatten_model_state(shards[(1, 0)]["model"])
    halved = [k for k in full if shard[k].shape != full[k].shape]
    assert "language_model.encoder.layers.1.mlp.dense_4h_to_h.weight" in halved
    assert "language_model.encoder.layers.1.post_attention_layernorm.weight" not in halved
    assert ("language_model.output_layer.weight" in full) == (variant != "tied")
    assert any(k.endswith(".bias") and "layernorm" not in k for k in full) == (variant == "tied")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layout_split_of_the_tp1_model_gives_the_saved_tp2_shards(saved, variant):
    full = _merged(saved[(1, variant)])
    _, shards = _read_shards(saved[(2, variant)])
    for rank, split in enumerate(GPT_LAYOUT.split_tensor_parallel(full, 2)):
        saved_shard = flatten_model_state(shards[(rank, 0)]["model"])
        assert list(split) == list(saved_shard)
        assert all(torch.equal(split[k], saved_shard[k]) for k in split), rank


def test_merged_model_nests_as_a_tp1_checkpoint(saved):
    _, shards = _read_shards(saved[(1, "tied")])
    nested = nest_model_state(_merged(saved[(2, "tied")]))
    assert _structure(nested) == _structure(shards[(0, 0)]["model"])


def _structure(node):
    if isinstance(node, dict):
        return {k: _structure(v) for k, v in node.items()}
    return tuple(node.shape)
