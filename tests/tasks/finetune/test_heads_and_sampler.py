"""The finetuning heads (Megatron's Classification / MultipleChoice: checkpoint keys, shapes,
loading a pretrained BERT) and the epoch sampler (data-parallel shards, resume, --keep-last).
One process, no process groups."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron.config import parse_args
from megatron.core.models.bert import BertModel
from megatron.core.models.builder import build_model_stage
from megatron.core.models.bert_heads import Classification, MultipleChoice
from megatron.training.models import bert_transformer_config
from tasks.finetune_utils import EpochBatchSampler, finetune_transformer_config
from tasks.finetune_sample_data import write_vocab


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    vocab = write_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt")
    return parse_args(["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
                       "--seq-length", "8", "--max-position-embeddings", "8",
                       "--micro-batch-size", "2", "--tokenizer-type", "BertWordPieceLowerCase",
                       "--vocab-file", str(vocab), "--hidden-dropout", "0.0",
                       "--attention-dropout", "0.0"])


def _inputs(b, s, *lead):
    torch.manual_seed(0)
    ids = torch.randint(5, 40, (*lead, b, s))
    mask = torch.ones_like(ids)
    mask[..., -2:] = 0
    return ids, mask, (torch.arange(s) >= s // 2).long().expand_as(ids).contiguous()


def test_classification_keys_and_shapes(cfg):
    torch.manual_seed(1)
    model = build_model_stage(Classification, finetune_transformer_config(cfg), num_classes=3)
    sd = model.state_dict_for_save_checkpoint()
    assert set(sd) == {"language_model", "classification_head"}  # no LM head, no tied copy
    assert set(sd["classification_head"]) == {"weight", "bias"}
    assert sd["classification_head"]["weight"].shape == (3, 16)
    assert "pooler" in sd["language_model"]
    assert "tokentype_embeddings" in sd["language_model"]["embedding"]
    ids, mask, types = _inputs(5, 8)
    assert model(ids, mask, tokentype_ids=types).shape == (5, 3)


def test_multiple_choice_scores_each_choice_alone(cfg):
    torch.manual_seed(1)
    model = build_model_stage(MultipleChoice, finetune_transformer_config(cfg)).eval()
    assert set(model.state_dict_for_save_checkpoint()) == {"language_model", "multichoice_head"}
    ids, mask, types = _inputs(4, 8, 3)  # [b=3, c=4, s=8]
    logits = model(ids, mask, tokentype_ids=types)
    assert logits.shape == (3, 4)
    with torch.no_grad():
        one = model(ids[1:2, 2:3], mask[1:2, 2:3], tokentype_ids=types[1:2, 2:3])
    torch.testing.assert_close(one[0, 0], logits[1, 2], rtol=1e-5, atol=1e-6)


def _pretrained_bert(cfg, binary_head: bool):
    torch.manual_seed(7)
    config = bert_transformer_config(cfg)
    if not binary_head:
        config = type(config)(**{**config.__dict__, "num_tokentypes": 0})
    return build_model_stage(BertModel, config, add_binary_head=binary_head)


def test_pretrained_bert_loads_into_a_new_head(cfg, caplog):
    bert = _pretrained_bert(cfg, binary_head=True)
    torch.manual_seed(1)
    model = build_model_stage(Classification, finetune_transformer_config(cfg), num_classes=2)
    head = {k: v.clone() for k, v in model.classification_head.state_dict().items()}
    with caplog.at_level(logging.INFO):
        model.load_state_dict(bert.state_dict_for_save_checkpoint(), strict=False)
    assert "binary_head, lm_head dropped" in caplog.text
    assert "classification_head.weight" in caplog.text  # initialized afresh, and said so
    mine = model.state_dict()
    for name, value in bert.language_model.state_dict().items():
        torch.testing.assert_close(mine[f"language_model.{name}"], value, rtol=0, atol=0)
    for name, value in head.items():
        torch.testing.assert_close(model.classification_head.state_dict()[name], value)
    # Resuming a finetuning run is strict: a checkpoint without the head is refused.
    with pytest.raises(ValueError, match="missing keys: classification_head.bias"):
        model.load_state_dict(bert.state_dict_for_save_checkpoint(), strict=True)


def test_bert_without_binary_head_keeps_a_fresh_pooler(cfg, caplog):
    bert = _pretrained_bert(cfg, binary_head=False)
    torch.manual_seed(1)
    model = build_model_stage(MultipleChoice, finetune_transformer_config(cfg))
    pooler = model.language_model.pooler.dense.weight.clone()
    with caplog.at_level(logging.INFO):
        model.load_state_dict(bert.state_dict_for_save_checkpoint(), strict=False)
    assert "language_model.pooler.dense.weight" in caplog.text
    assert "language_model.embedding.tokentype_embeddings.weight" in caplog.text
    assert torch.equal(model.language_model.pooler.dense.weight, pooler)


def test_pretrained_bert_of_another_depth_is_refused(cfg):
    # Megatron-LM loads the pretrained body strictly: layers missing from (or left over in)
    # the checkpoint must not finetune half-initialized (a checkpoint without args, whose
    # --num-layers cannot be checked).
    shallow = parse_args(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads",
                          "2", "--seq-length", "8", "--max-position-embeddings", "8",
                          "--micro-batch-size", "2", "--tokenizer-type", "BertWordPieceLowerCase",
                          "--vocab-file", cfg.tokenizer.vocab_file])
    torch.manual_seed(7)
    one_layer = build_model_stage(BertModel, bert_transformer_config(shallow),
                                  add_binary_head=True)
    two_layers = build_model_stage(Classification, finetune_transformer_config(cfg), num_classes=2)
    with pytest.raises(ValueError, match="missing body weights: language_model.encoder.layers.1"):
        two_layers.load_state_dict(one_layer.state_dict_for_save_checkpoint(), strict=False)
    one_layer_head = build_model_stage(MultipleChoice, finetune_transformer_config(shallow))
    with pytest.raises(ValueError, match="does not have: language_model.encoder.layers.1"):
        one_layer_head.load_state_dict(_pretrained_bert(cfg, True).state_dict_for_save_checkpoint(),
                                       strict=False)
    # A model finetuned on another task (its head ignored) still starts a new one, as Megatron.
    race = build_model_stage(MultipleChoice, finetune_transformer_config(cfg))
    two_layers.load_state_dict(race.state_dict_for_save_checkpoint(), strict=False)
    torch.testing.assert_close(two_layers.language_model.pooler.dense.weight,
                               race.language_model.pooler.dense.weight, rtol=0, atol=0)


def test_shape_mismatch_is_refused_even_when_not_strict(cfg):
    torch.manual_seed(1)
    three = build_model_stage(Classification, finetune_transformer_config(cfg), num_classes=3)
    two = build_model_stage(Classification, finetune_transformer_config(cfg), num_classes=2)
    with pytest.raises(ValueError, match="classification_head.weight: checkpoint \\(3, 16\\) "
                                         "vs model \\(2, 16\\)"):
        two.load_state_dict(three.state_dict_for_save_checkpoint(), strict=False)


def _epoch(n, mbs, dp, nmb=1, **kw):
    """Per global batch, the per-rank micro-batches of every DP rank."""
    ranks = [list(EpochBatchSampler(n, mbs, r, dp, num_microbatches=nmb, seed=3, **kw))
             for r in range(dp)]
    return ranks


def test_data_parallel_shards_make_the_single_rank_batches():
    single = _epoch(20, 4, 1)[0]  # 5 batches of 4
    two = _epoch(20, 2, 2)
    assert len(single) == 5 and all(len(b) == 4 for b in single)
    for step, batch in enumerate(single):
        assert sorted(two[0][step] + two[1][step]) == sorted(batch)
    # Two micro-batches per step: a step covers the same 8 samples as one 8-sample batch.
    acc = _epoch(20, 2, 2, nmb=2)
    big = _epoch(20, 8, 1)[0]
    assert len(acc[0]) == 4 and len(big) == 2  # 20 // 8 = 2 steps, the last 4 dropped
    assert sorted(sum(acc[0][:2] + acc[1][:2], [])) == sorted(big[0])
    assert EpochBatchSampler(20, 2, 0, 2, num_microbatches=2).iterations() == 2


def test_epochs_reshuffle_and_resume_skips_whole_batches():
    first = _epoch(16, 4, 1, epoch=0)[0]
    assert _epoch(16, 4, 1, epoch=0)[0] == first
    assert _epoch(16, 4, 1, epoch=1)[0] != first
    assert _epoch(16, 4, 1, epoch=0, start_iteration=3)[0] == first[3:]
    assert sorted(sum(first, [])) == list(range(16))


def test_keep_last_covers_every_sample():
    dropped = _epoch(10, 2, 2)
    assert len(dropped[0]) == 2  # 10 // 4: two samples never seen
    kept = _epoch(10, 2, 2, drop_last=False)
    assert len(kept[0]) == 3 and [len(b) for b in kept[0]] == [2, 2, 1]
    assert set(sum(kept[0] + kept[1], [])) == set(range(10))
    with pytest.raises(ValueError, match="one micro-batch per step"):
        EpochBatchSampler(10, 2, 0, 2, num_microbatches=2, drop_last=False)
