"""The SQuAD span head: checkpoint keys and shapes, loss, and a pretrained BERT's body loading
into it (its pooler and pretraining heads dropped). One process, no process groups."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.config import parse_args
from megatron.core.models.bert import BertModel
from megatron.core.models.builder import build_model_stage
from megatron.training.models import bert_transformer_config
from tasks.squad.model import QuestionAnswering, span_loss_func, squad_model_provider


@pytest.fixture(scope="module")
def cfg(shared_data):
    return parse_args(["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
                       "--seq-length", "8", "--max-position-embeddings", "8",
                       "--micro-batch-size", "2", "--tokenizer-type", "BertWordPieceLowerCase",
                       "--vocab-file", str(shared_data / "tokenizers" /
                                           "bert-base-uncased-vocab.txt"),
                       "--hidden-dropout", "0.0", "--attention-dropout", "0.0"])


def _inputs(b: int, s: int):
    torch.manual_seed(0)
    ids = torch.randint(1000, 2000, (b, s))
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0
    return ids, mask, (torch.arange(s) >= 3).long().expand_as(ids).contiguous()


def test_span_head_keys_shapes_and_loss(cfg):
    torch.manual_seed(1)
    model = squad_model_provider(cfg)
    assert isinstance(model, QuestionAnswering)
    sd = model.state_dict_for_save_checkpoint()
    assert set(sd) == {"language_model", "qa_head"}
    assert {k: tuple(v.shape) for k, v in sd["qa_head"].items()} == {"weight": (2, 16),
                                                                      "bias": (2,)}
    assert "pooler" not in sd["language_model"]  # the span head reads every position
    ids, mask, types = _inputs(3, 8)
    logits = model(ids, mask, tokentype_ids=types)
    assert logits.shape == (3, 8, 2)
    start, end = torch.tensor([1, 4, 0]), torch.tensor([2, 5, 0])
    loss, reported = span_loss_func(start, end, None, logits)
    expected = (F.cross_entropy(logits[..., 0], start) + F.cross_entropy(logits[..., 1], end)) / 2
    torch.testing.assert_close(loss, expected)
    assert reported["lm loss"].item() == pytest.approx(expected.item())


def test_pretrained_bert_body_loads_into_the_span_model(cfg, caplog):
    torch.manual_seed(7)
    bert = build_model_stage(BertModel, bert_transformer_config(cfg), add_binary_head=True)
    torch.manual_seed(1)
    model = squad_model_provider(cfg)
    head = {k: v.clone() for k, v in model.qa_head.state_dict().items()}
    with caplog.at_level("INFO"):
        model.load_state_dict(bert.state_dict_for_save_checkpoint(), strict=False)
    assert "binary_head, lm_head dropped" in caplog.text
    body = bert.state_dict_for_save_checkpoint()["language_model"]["encoder"]
    for name, value in model.language_model.encoder.state_dict().items():
        torch.testing.assert_close(value, body[name], rtol=0, atol=0)
    for name, value in model.qa_head.state_dict().items():
        torch.testing.assert_close(value, head[name], rtol=0, atol=0)  # new head kept
    # A finetuned span model's own checkpoint loads strictly.
    again = squad_model_provider(cfg)
    again.load_state_dict(model.state_dict_for_save_checkpoint(), strict=True)
    ids, mask, types = _inputs(2, 8)
    torch.testing.assert_close(again(ids, mask, tokentype_ids=types),
                               model(ids, mask, tokentype_ids=types))
