"""The language-model base shared by GPT and BERT: pipeline stages and their
Megatron checkpoint keys, the tied output weight's copy on the last stage (equal to stage 0's
after the build, gradients adding up to the one-stage model's), the hooks a subclass adds its
head and checkpoint sections through, and the boundary to the CLI config (the model library is
built from a TransformerConfig; only ``megatron.training.models`` reads the flags)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from megatron.config import parse_args
from megatron.core import device
from megatron.core import parallel_state as ps
from megatron.core.checkpoint_keys import flatten_checkpoint_state_dict
from megatron.core.flops import num_floating_point_operations
from megatron.core.models.builder import build_model_stage
from megatron.core.models.gpt import GPTModel
from megatron.core.models.language_module import LanguageModule
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer.config import TransformerConfig
from megatron.config.core_configs import transformer_config
from megatron.training.models import gpt_flops_per_sample
from tests.multiprocess import run_distributed

REPO = Path(__file__).resolve().parents[3]
DT = torch.float64
VOCAB, SEQ, BATCH, HIDDEN = 64, 8, 2, 16
CONFIG = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4,
                           padded_vocab_size=VOCAB, max_position_embeddings=SEQ,
                           hidden_dropout=0.0, attention_dropout=0.0, params_dtype=DT)
LAYER_KEYS = {f"language_model.encoder.layers.0.{m}.{p}" for p in ("weight", "bias") for m in (
    "input_layernorm", "self_attention.query_key_value", "self_attention.dense",
    "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")}
# Megatron-LM 23.06's keys of a 2-layer GPT split in two stages (docs/FORMATS.md, 2d;
# layer numbers are local to the stage).
FIRST_STAGE_KEYS = LAYER_KEYS | {"language_model.embedding.word_embeddings.weight",
                                 "language_model.embedding.position_embeddings.weight"}
LAST_STAGE_KEYS = LAYER_KEYS | {"language_model.encoder.final_layernorm.weight",
                                "language_model.encoder.final_layernorm.bias",
                                "word_embeddings_for_head.weight"}


def _batch():
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(device.get_device())
    position_ids = torch.arange(SEQ, device=tokens.device).expand(BATCH, SEQ)
    return tokens[:, :-1], position_ids, tokens[:, 1:]


def _megatron_keys(nested: dict, prefix: str = "") -> set[str]:
    """The dotted keys of a nested checkpoint dict, names unchanged."""
    keys = set()
    for key, value in nested.items():
        if isinstance(value, dict):
            keys |= _megatron_keys(value, f"{prefix}{key}.")
        else:
            keys.add(prefix + key)
    return keys


def _stage_checkpoint(full: dict, stage: int) -> dict:
    """A one-stage checkpoint dict (flat Megatron keys) cut into stage ``stage`` of two, as
    Megatron's checkpoint converter would: layer 1 becomes the last stage's layer 0, and the
    last stage's ``word_embeddings_for_head`` is the word embedding."""
    out = {}
    for key, value in full.items():
        if stage == 0 and not key.startswith(("language_model.encoder.layers.1.",
                                              "language_model.encoder.final_layernorm.")):
            out[key] = value
        elif stage == 1 and key.startswith("language_model.encoder.layers.1."):
            out[key.replace("layers.1.", "layers.0.")] = value
        elif stage == 1 and key.startswith("language_model.encoder.final_layernorm."):
            out[key] = value
    if stage == 1:
        out["word_embeddings_for_head.weight"] = \
            full["language_model.embedding.word_embeddings.weight"]
    return out


def test_two_stage_split_keys_and_tied_gradients():
    """A tiny GPT split in two stages in one process: each stage saves Megatron's keys; loaded
    from the one-stage model's weights, the chained stages give its loss, and the gradients of
    the embedding (stage 0) and its copy (stage 1), summed as finalize_model_grads does, are
    the one-stage model's embedding gradient."""
    torch.manual_seed(0)
    full = GPTModel(CONFIG, None)
    first = GPTModel(CONFIG, None, pre_process=True, post_process=False, num_layers=1)
    last = GPTModel(CONFIG, None, pre_process=False, post_process=True, num_layers=1,
                    layer_offset=1)
    last_nested = last.state_dict_for_save_checkpoint()
    assert _megatron_keys(first.state_dict_for_save_checkpoint()) == FIRST_STAGE_KEYS
    assert list(last_nested) == ["language_model", "word_embeddings_for_head"]
    assert _megatron_keys(last_nested) == LAST_STAGE_KEYS
    # The copy starts as zeros (initialize_word_embeddings fills it); it is the duplicate the
    # grad norm skips, while stage 0's embedding is counted and marked as having a twin.
    copy = last.shared_embedding_or_output_weight()
    assert copy is last.word_embeddings.weight and not copy.any()
    assert copy.shared and copy.shared_embedding
    embedding = first.shared_embedding_or_output_weight()
    assert embedding.shared_embedding and not getattr(embedding, "shared", False)
    assert not getattr(full.shared_embedding_or_output_weight(), "shared_embedding", False)

    full_sd = flatten_checkpoint_state_dict(full.state_dict_for_save_checkpoint())
    first.load_state_dict(_stage_checkpoint(full_sd, 0))
    last.load_state_dict(_stage_checkpoint(full_sd, 1))
    ids, pos, labels = _batch()
    ref = full(ids, pos, labels=labels)  # [b, s]
    ref.sum().backward()
    hidden = first(ids, pos)  # [s, b, h]
    received = hidden.detach().requires_grad_()
    last.set_input_tensor(received)
    loss = last(None, None, labels=labels)  # [b, s]
    loss.sum().backward()
    hidden.backward(received.grad)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    ref_grads = dict(full.named_parameters())
    torch.testing.assert_close(embedding.grad + copy.grad,
                               ref_grads["language_model.embedding.word_embeddings.weight"].grad,
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        last.language_model.encoder.final_layernorm.weight.grad,
        ref_grads["language_model.encoder.final_layernorm.weight"].grad, rtol=1e-10, atol=1e-12)


def _build_stages(rank, world_size, untie):
    """TP = 2 x PP = 2: every rank builds its stage with Megatron's per-stage seed."""
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    tp_rank = ps.get_tensor_model_parallel_rank()
    torch.manual_seed(1234 + 100 * pp_rank)
    model_parallel_manual_seed(1234 + 100 * pp_rank, tp_rank)
    config = dataclasses.replace(CONFIG, untie_embeddings_and_output_weights=untie)
    model = build_model_stage(GPTModel, config)
    weight = model.shared_embedding_or_output_weight()
    keys = _megatron_keys(model.state_dict_for_save_checkpoint())
    return {"pp": pp_rank, "tp": tp_rank, "pre": model.pre_process,
            "post": model.post_process, "keys": keys, "weight": weight.detach().cpu()}


def test_tied_copies_start_equal_across_stages():
    """Built by build_model_stage at TP = 2, PP = 2, the last stage's copy of the tied weight is,
    shard for shard, stage 0's word embedding (not zeros); each stage holds its layers only;
    untied, the last stage's output layer is its own (drawn, not copied)."""
    results = run_distributed(4, _build_stages, False)
    by_place = {(r["pp"], r["tp"]): r for r in results}
    for tp in (0, 1):
        first, last = by_place[(0, tp)], by_place[(1, tp)]
        assert (first["pre"], first["post"], last["pre"], last["post"]) == \
            (True, False, False, True)
        assert first["keys"] == FIRST_STAGE_KEYS and last["keys"] == LAST_STAGE_KEYS
        assert first["weight"].shape == (VOCAB // 2, HIDDEN)
        assert first["weight"].abs().sum() > 0
        assert torch.equal(last["weight"], first["weight"])
    assert not torch.equal(by_place[(0, 0)]["weight"], by_place[(0, 1)]["weight"])
    untied = {(r["pp"], r["tp"]): r for r in run_distributed(4, _build_stages, True)}
    for tp in (0, 1):
        last = untied[(1, tp)]
        assert "word_embeddings_for_head.weight" not in last["keys"]
        assert "language_model.output_layer.weight" in last["keys"]
        assert not torch.equal(last["weight"], untied[(0, tp)]["weight"])


class _TaggerModel(LanguageModule):
    """A toy model with BERT's kind of additions: a padding mask, an extra head of its own
    beside the tied weight, and that head's checkpoint section."""

    checkpoint_name = "Tagger"
    attn_mask_type = "padding"

    def __init__(self, config, tp_group, **kwargs):
        super().__init__(config, tp_group, **kwargs)
        self.binary_head = None
        if self.post_process:
            self.binary_head = torch.nn.Linear(config.hidden_size, 2, dtype=config.params_dtype,
                                               device=device.get_device())
            self.set_parameter_defaults()

    def forward(self, input_ids, position_ids, labels=None, tokentype_ids=None):
        hidden = self.language_model(input_ids, position_ids, None, tokentype_ids)
        if not self.post_process:
            return hidden
        logits = self.binary_head(hidden)  # [s, b, 2]
        if labels is None:
            return logits.transpose(0, 1)
        return torch.nn.functional.cross_entropy(logits.transpose(0, 1).flatten(0, 1),
                                                 labels.flatten(), reduction="none")

    def extra_state_dict_sections(self):
        if self.binary_head is None:
            return {}
        return {"binary_head": self.binary_head.state_dict()}


def test_subclass_adds_head_and_checkpoint_sections():
    """A subclass's mask type and checkpoint section go through the base's hooks: saved in
    Megatron's order (language_model, the heads, word_embeddings_for_head), loaded back, and
    reported by name when missing; its parameters get the TP attributes."""
    config = dataclasses.replace(CONFIG, num_tokentypes=2)
    torch.manual_seed(0)
    model = _TaggerModel(config, None)
    assert model.language_model.encoder.layers[0].self_attention.core_attention.attn_mask_type \
        == "padding"
    assert model.binary_head.weight.tensor_model_parallel is False
    sd = model.state_dict_for_save_checkpoint()
    assert list(sd) == ["language_model", "binary_head"]
    last = _TaggerModel(config, None, pre_process=False, num_layers=1)
    assert list(last.state_dict_for_save_checkpoint()) == \
        ["language_model", "binary_head", "word_embeddings_for_head"]

    torch.manual_seed(1)
    other = _TaggerModel(config, None)
    other.load_state_dict(sd)
    assert torch.equal(other.binary_head.weight, model.binary_head.weight)
    ids, pos, _ = _batch()
    types = torch.zeros_like(ids)
    torch.testing.assert_close(other(ids, pos, tokentype_ids=types),
                               model(ids, pos, tokentype_ids=types))
    del sd["binary_head"]
    with pytest.raises(ValueError, match="Tagger checkpoint does not fit the model:\n  "
                                         "missing keys: binary_head.bias, binary_head.weight"):
        other.load_state_dict(sd)


def _function_args(path: Path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text())
    return [(node.name, arg.arg) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for arg in node.args.args + node.args.kwonlyargs]


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {node.module for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and node.module}
    names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
              for alias in node.names}
    return names


def test_model_library_never_reads_the_cli_config():
    """The models, the transformer and the FLOPs count take a TransformerConfig: no function
    there takes the CLI config (``cfg``, its name in every top-layer function) or imports
    megatron.config / megatron.training; the flags are mapped in megatron.training.models."""
    core = REPO / "megatron" / "core"
    files = [*sorted((core / "models").glob("*.py")), *sorted((core / "transformer").glob("*.py")),
             core / "flops.py"]
    offenders = [f"{path.relative_to(REPO)}: {func}({arg})" for path in files
                 for func, arg in _function_args(path) if arg == "cfg"]
    assert offenders == []
    imports = [f"{path.relative_to(REPO)}: {name}" for path in files
               for name in _imported_modules(path)
               if name.startswith(("megatron.config", "megatron.training"))]
    assert imports == []

    cfg = parse_args(["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
                      "--max-position-embeddings", "8", "--seq-length", "8",
                      "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", str(VOCAB - 1), "--make-vocab-size-divisible-by",
                      str(VOCAB)], world_size=1)
    assert cfg.padded_vocab_size == VOCAB  # the vocabulary and its end-of-document token
    config = transformer_config(cfg)
    assert (config.num_layers, config.hidden_size, config.padded_vocab_size) == (2, 16, VOCAB)
    assert gpt_flops_per_sample(cfg) == num_floating_point_operations(config, 1, 8)


@pytest.mark.parametrize("layers,pp,vpp", [(8, 2, None), (8, 4, None), (8, 2, 2), (8, 4, 2),
                                           (12, 3, 4), (6, 1, None)])
def test_stage_layer_offsets_match_the_checkpoint_layout(layers, pp, vpp):
    """Megatron's offsets (``pp_rank * L/pp``; interleaved ``vpp_rank * L/vpp +
    pp_rank * L/(pp*vpp)``), as the checkpoint format's table has them: every layer on exactly
    one chunk."""
    from megatron.checkpointing.stages import PipelineStages
    from megatron.core.models.builder import pipeline_stage_layers

    table = PipelineStages(layers, pp, vpp).chunks()
    seen = []
    for chunk in table:
        got = pipeline_stage_layers(layers, pp, chunk.pipeline_rank, vpp, chunk.virtual_rank)
        assert got == (chunk.num_layers, chunk.first_layer), chunk
        seen += range(got[1], got[1] + got[0])
    assert sorted(seen) == list(range(layers))
    if vpp == 2 and pp == 2:  # stage 0 holds layers 0-1 and 4-5, stage 1 layers 2-3 and 6-7
        assert pipeline_stage_layers(8, 2, 0, 2, 1) == (2, 4)


def test_stage_layers_refuse_an_uneven_split():
    from megatron.core.models.builder import pipeline_stage_layers

    with pytest.raises(ValueError, match=r"num_layers \(8\).*\(3\)"):
        pipeline_stage_layers(8, 3, 0)
    with pytest.raises(ValueError, match="virtual stages"):
        pipeline_stage_layers(8, 2, 0, 3, 0)


def test_data_parallel_wrappers_pass_the_pipeline_input_on():
    """The schedules call ``set_input_tensor`` on the DDP-wrapped chunk: it reaches the block."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                               padded_vocab_size=64, max_position_embeddings=8,
                               hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, None, pre_process=False, post_process=False, num_layers=1,
                     layer_offset=1)
    wrapped = DistributedDataParallel(model, DistributedDataParallelConfig(), dp_group=None)
    activation = torch.randn(8, 2, 16)
    wrapped.set_input_tensor(activation)
    assert model.language_model.encoder.input_tensor is activation
    assert model.language_model.encoder.layers[0].layer_number == 2
    assert wrapped(None, None).shape == (8, 2, 16)
