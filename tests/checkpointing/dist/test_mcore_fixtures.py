"""Checkpoints written by real Megatron-Core 0.19.2 (``../shared/data/mcore``) load through the
``torch_dist`` reader into our models and give Megatron-Core's recorded logits, at TP=1 and
TP=2 (the TP=2 checkpoint at TP=1 and the TP=1 checkpoint at TP=2 too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.multiprocess import run_distributed

MCORE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "mcore"
pytestmark = pytest.mark.skipif(not MCORE.is_dir(), reason=f"{MCORE} is not here")
TOL = 1e-5


def _config(name: str):
    from megatron.core.transformer.config import TransformerConfig
    cfg = json.loads((MCORE / name / "config.json").read_text())
    tc, gm = cfg["TransformerConfig"], cfg["GPTModel"]
    llama = tc.get("normalization") == "RMSNorm"
    return TransformerConfig(
        num_layers=tc["num_layers"], hidden_size=tc["hidden_size"],
        num_attention_heads=tc["num_attention_heads"],
        ffn_hidden_size=tc.get("ffn_hidden_size", 4 * tc["hidden_size"]),
        num_query_groups=tc.get("num_query_groups"), padded_vocab_size=gm["vocab_size"],
        max_position_embeddings=gm["max_sequence_length"],
        position_embedding_type="rope" if llama else "learned_absolute",
        add_position_embedding=not llama, rotary_base=gm.get("rotary_base", 10000),
        untie_embeddings_and_output_weights=not gm["share_embeddings_and_output_weights"],
        normalization=tc.get("normalization", "LayerNorm"),
        add_bias_linear=tc.get("add_bias_linear", True), swiglu=llama,
        hidden_dropout=0.0, attention_dropout=0.0, bias_gelu_fusion=False)


def _logits_after_load(rank, world, name, checkpoint, tp):
    from megatron.checkpointing.dist.model import Layout, load_weights
    from megatron.core import parallel_state as ps
    from megatron.core.models.builder import build_model_stage
    from megatron.core.models.gpt import GPTModel
    ps.initialize_model_parallel(tp, 1)
    config = _config(name)
    torch.manual_seed(99)  # other weights than Megatron-Core's: the load must replace them
    model = build_model_stage(GPTModel, config, parallel_output=False)
    load_weights([model], MCORE / checkpoint, Layout.from_parallel_state(config.num_layers),
                 config.swiglu)
    inputs = torch.load(MCORE / "llama_rope10k" / "outputs.pt", weights_only=True)
    model.eval()
    with torch.no_grad():
        logits = model(inputs["input_ids"], inputs["position_ids"].expand(2, -1),
                       inputs["attention_mask"])
    return logits


@pytest.mark.parametrize("name,checkpoint,tp", [
    ("gpt2", "gpt2/torch_dist", 1),
    ("gpt2", "gpt2/torch_dist", 2),
    ("llama_rope10k", "llama_rope10k/torch_dist", 1),
    ("llama_rope10k", "llama_rope10k/torch_dist_wrapped", 1),
    ("llama_rope10k", "llama_rope10k/torch_dist", 2),
    ("llama_rope10k", "llama_rope10k_tp2/torch_dist", 2),
    ("llama_rope10k", "llama_rope10k_tp2/torch_dist", 1),
])
def test_megatron_core_checkpoint_gives_its_logits(name, checkpoint, tp):
    expected = torch.load(MCORE / name / "outputs.pt", weights_only=True)["logits"]
    for logits in run_distributed(tp, _logits_after_load, name, checkpoint, tp):
        assert logits.shape == expected.shape
        assert (logits - expected).abs().max().item() < TOL


def test_common_state_reads_without_a_process_group():
    from megatron.checkpointing.dist import storage
    assert storage.read_common_state(MCORE / "llama_rope10k" / "torch_dist") == {}
    wrapped = storage.read_common_state(MCORE / "llama_rope10k" / "torch_dist_wrapped")
    assert wrapped == {"checkpoint_version": 3.0, "iteration": 7}
    assert storage.is_torch_dist_dir(MCORE / "gpt2" / "torch_dist")
