"""The static TP/PP layout of GPT checkpoints, checked against the model code
with no process group: every key a GPT stage saves (tied / untied embeddings, with / without
biases, 1, 2 and 4 pipeline stages) has a rule; each rule's TP dim is the dim the model's own
parameter is split on; splitting a one-stage state over stages gives exactly the keys, shapes
and layer numbers the stage models save; splits and merges round-trip exactly; Megatron-LM's
own key list (older names included) is covered and other keys are refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.checkpointing import (GPT_LAYOUT, CheckpointError, PipelineStages, TensorRule,
                                    flatten_model_state, nest_model_state)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.builder import pipeline_stage_layers
from megatron.core.transformer.config import TransformerConfig

LAYERS = 4
CONFIG = TransformerConfig(num_layers=LAYERS, hidden_size=16, num_attention_heads=4,
                           padded_vocab_size=64, max_position_embeddings=8, hidden_dropout=0.0,
                           attention_dropout=0.0)
VARIANTS = {
    "tied": {},
    "untied": {"untie_embeddings_and_output_weights": True},
    "tied_no_bias": {"add_bias_linear": False},
    "untied_no_bias": {"untie_embeddings_and_output_weights": True, "add_bias_linear": False},
}
# Megatron-LM 23.06's keys of a GPT checkpoint (docs/FORMATS.md 2d), and the older names
# (``transformer``, ``.attention.``) its loader still maps.
MEGATRON_KEYS = [
    "language_model.embedding.word_embeddings.weight",
    "language_model.embedding.position_embeddings.weight",
    "language_model.embedding.tokentype_embeddings.weight",
    *(f"language_model.{encoder}.layers.11.{module}.{p}" for encoder in ("encoder", "transformer")
      for p in ("weight", "bias") for module in (
          "input_layernorm", "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h",
          "self_attention.query_key_value", "self_attention.dense",
          "attention.query_key_value", "attention.dense")),
    "language_model.encoder.final_layernorm.weight", "language_model.encoder.final_layernorm.bias",
    "language_model.transformer.final_layernorm.weight",
    "language_model.output_layer.weight", "word_embeddings_for_head.weight",
]


def _stages(config: TransformerConfig, pp: int) -> list[GPTModel]:
    """The pipeline stages of a GPT, as the model code builds them (one process, TP = 1)."""
    torch.manual_seed(0)
    out = []
    for rank in range(pp):
        layers, offset = pipeline_stage_layers(config.num_layers, pp, rank)
        out.append(GPTModel(config, None, pre_process=rank == 0, post_process=rank == pp - 1,
                            num_layers=layers, layer_offset=offset))
    return out


def _flat(model: GPTModel) -> dict[str, torch.Tensor]:
    return flatten_model_state(model.state_dict_for_save_checkpoint())


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    config = dataclasses.replace(CONFIG, **VARIANTS[request.param])
    return {pp: _stages(config, pp) for pp in (1, 2, 4)}


def test_every_key_of_every_stage_has_a_rule(variant):
    for pp, stages in variant.items():
        for rank, model in enumerate(stages):
            keys = list(_flat(model))
            assert keys, (pp, rank)
            assert GPT_LAYOUT.unknown_keys(keys) == [], (pp, rank)


def test_rules_split_the_dim_the_model_splits(variant):
    """Each rule's TP dim is the ``partition_dim`` of the parameter the key saves (None for the
    parameters every TP rank holds whole): the table agrees with the tensor-parallel layers."""
    checked = set()
    for stages in variant.values():
        for model in stages:
            params = {p.data_ptr(): p for p in model.parameters()}
            for key, tensor in _flat(model).items():
                param = params[tensor.data_ptr()]
                split = param.partition_dim if param.tensor_model_parallel else None
                assert GPT_LAYOUT.rule(key).tp_dim == split, key
                checked.add(GPT_LAYOUT.rule(key).pattern)
    assert len(checked) >= 9  # the variant's rules, not a lucky few


def test_pipeline_split_gives_the_stage_models_keys_and_shapes(variant):
    full = _flat(variant[1][0])
    for pp in (2, 4):
        split = GPT_LAYOUT.split_pipeline(full, PipelineStages(LAYERS, pp))
        for rank, (state, model) in enumerate(zip(split, variant[pp])):
            expected = {k: tuple(v.shape) for k, v in _flat(model).items()}
            assert list(state) == list(expected), (pp, rank)  # Megatron's order too
            assert {k: tuple(v.shape) for k, v in state.items()} == expected, (pp, rank)


def test_pipeline_merge_renumbers_layers_and_drops_the_head_copy(variant):
    full = _flat(variant[1][0])
    for pp in (2, 4):
        merged = GPT_LAYOUT.merge_pipeline([_flat(m) for m in variant[pp]],
                                           PipelineStages(LAYERS, pp))
        assert list(merged) == list(full)
        assert all(merged[k].shape == full[k].shape for k in full)
        assert _same(GPT_LAYOUT.merge_pipeline(
            GPT_LAYOUT.split_pipeline(full, PipelineStages(LAYERS, pp)),
            PipelineStages(LAYERS, pp)), full)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_split_and_merge_round_trip(variant, tp):
    full = _flat(variant[1][0])
    shards = GPT_LAYOUT.split_tensor_parallel(full, tp)
    for key, value in full.items():
        dim = GPT_LAYOUT.rule(key).tp_dim
        for rank, shard in enumerate(shards):
            if dim is None:
                assert torch.equal(shard[key], value)
            else:
                assert torch.equal(shard[key], value.chunk(tp, dim)[rank])
                assert shard[key].untyped_storage().nbytes() < value.untyped_storage().nbytes()
    assert _same(GPT_LAYOUT.merge_tensor_parallel(shards), full)


def test_nesting_is_megatrons(variant):
    for stages in variant.values():
        for model in stages:
            nested = model.state_dict_for_save_checkpoint()
            assert _structure(nest_model_state(flatten_model_state(nested))) == \
                _structure(nested)


def test_megatron_key_list_has_rules_and_other_keys_are_refused():
    assert GPT_LAYOUT.unknown_keys(MEGATRON_KEYS) == []
    assert GPT_LAYOUT.rule("language_model.transformer.layers.3.attention.dense.weight").tp_dim \
        == 1
    foreign = ["lm_head.bias", "language_model.encoder.layers.0.self_attention.rotary.inv_freq",
               "language_model.encoder.layers.x.input_layernorm.weight"]
    assert GPT_LAYOUT.unknown_keys(foreign) == foreign
    with pytest.raises(CheckpointError, match=r"lm_head\.bias, .*rotary\.inv_freq"):
        GPT_LAYOUT.check_keys(foreign, "shard 3")
    with pytest.raises(CheckpointError, match="lm_head.bias"):
        GPT_LAYOUT.split_tensor_parallel({"lm_head.bias": torch.zeros(4)}, 2)


def test_another_family_extends_the_table():
    bert = GPT_LAYOUT.extended("BERT", [
        TensorRule("lm_head.bias", 0, "last", padded_vocab=True),
        TensorRule("binary_head.{weight,bias}", None, "last")])
    assert bert.rule("lm_head.bias").tp_dim == 0 and bert.rule("binary_head.bias").tp_dim is None
    assert bert.rule("language_model.embedding.word_embeddings.weight").padded_vocab
    assert GPT_LAYOUT.unknown_keys(["lm_head.bias"]) == ["lm_head.bias"]
    with pytest.raises(ValueError, match="layer"):
        TensorRule("layers.{layer}.w", None, "last")


def test_virtual_pipeline_chunks_follow_megatrons_offsets():
    # ParallelTransformer: offset = v * (L / vp) + p * (L / (pp * vp)).
    stages = PipelineStages(8, 2, 2)
    chunks = stages.chunks()
    assert [(c.pipeline_rank, c.model_key, c.first_layer) for c in chunks] == [
        (0, "model0", 0), (0, "model1", 4), (1, "model0", 2), (1, "model1", 6)]
    assert [(c.pre_process, c.post_process) for c in chunks] == [
        (True, False), (False, False), (False, False), (False, True)]
    config = dataclasses.replace(CONFIG, num_layers=8)
    full = _flat(GPTModel(config, None))
    split = GPT_LAYOUT.split_pipeline(full, stages)
    assert "word_embeddings_for_head.weight" in split[3]
    assert torch.equal(split[1]["language_model.encoder.layers.1.mlp.dense_4h_to_h.weight"],
                       full["language_model.encoder.layers.5.mlp.dense_4h_to_h.weight"])
    assert _same(GPT_LAYOUT.merge_pipeline(split, stages), full)
    assert list(GPT_LAYOUT.merge_pipeline(split, stages)) == list(full)
    with pytest.raises(ValueError, match="not divisible"):
        PipelineStages(6, 4)


def test_misplaced_tensors_are_refused():
    stages = PipelineStages(LAYERS, 2)
    split = GPT_LAYOUT.split_pipeline(_flat(GPTModel(CONFIG, None)), stages)
    wrong_stage = [split[0], {**split[1], "language_model.embedding.position_embeddings.weight":
                              torch.zeros(8, 16)}]
    with pytest.raises(CheckpointError, match="position_embeddings.weight on pipeline stage 1: "
                                              "it belongs to the first stage"):
        GPT_LAYOUT.merge_pipeline(wrong_stage, stages)
    extra_layer = [{**split[0], "language_model.encoder.layers.2.input_layernorm.bias":
                    torch.zeros(16)}, split[1]]
    with pytest.raises(CheckpointError, match="holds 2 layers"):
        GPT_LAYOUT.merge_pipeline(extra_layer, stages)
    with pytest.raises(CheckpointError, match="1 model chunks for a pipeline of 2"):
        GPT_LAYOUT.merge_pipeline(split[:1], stages)
    with pytest.raises(CheckpointError, match="TP rank 1 holds other tensors"):
        GPT_LAYOUT.merge_tensor_parallel([split[0], split[1]])


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _structure(node):
    if isinstance(node, dict):
        return {k: _structure(v) for k, v in node.items()}
    return tuple(node.shape)


def test_one_virtual_chunk_per_stage_is_saved_as_model():
    """A virtual pipeline of size 1 (layers per virtual stage = layers per stage) is one model
    chunk per stage: the trainer saves it as ``model`` (as Megatron-LM saves a one-chunk list),
    so the converter must too (found by the layout fuzzer: the resume read no ``model``)."""
    chunks = PipelineStages(4, 2, 1).chunks()
    assert [c.model_key for c in chunks] == ["model", "model"]
    assert [(c.first_layer, c.num_layers) for c in chunks] == [(0, 2), (2, 2)]
    assert [c.model_key for c in PipelineStages(4, 2, 2).chunks()] == ["model0", "model1"] * 2
