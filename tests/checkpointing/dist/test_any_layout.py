"""A torch_dist checkpoint saved at TP=2 x PP=2 (4 gloo ranks) loads at TP=1 x DP=4, TP=4,
PP=4, TP=1 x PP=2 x DP=2 and with virtual stages: every parameter equals the saved one bitwise
(gathered to one-process names, with no use of the key table). The keys, global shapes and
chunks are Megatron-Core's."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.multiprocess import run_distributed
from tests.training.e2e import _gather_full_params

MCORE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "mcore"


def _config(vpp: bool = False):
    from megatron.core.transformer.config import TransformerConfig
    return TransformerConfig(num_layers=8 if vpp else 4, hidden_size=32, num_attention_heads=4,
                             padded_vocab_size=64, max_position_embeddings=16,
                             hidden_dropout=0.0, attention_dropout=0.0, bias_gelu_fusion=False)


def _build(tp, pp, vpp=None, seed=0):
    from megatron.core import parallel_state as ps
    from megatron.core.models.builder import build_model_stage
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.language_module import initialize_word_embeddings
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)
    config = _config(vpp=True)
    model = []
    for chunk in range(vpp or 1):
        if vpp:
            ps.set_virtual_pipeline_model_parallel_rank(chunk)
        torch.manual_seed(seed + 100 * ps.get_pipeline_model_parallel_rank() + chunk)
        model.append(build_model_stage(GPTModel, config))
    if vpp:
        ps.set_virtual_pipeline_model_parallel_rank(0)
    return config, model


def _save_then_load(rank, world, directory):
    from megatron.checkpointing.dist import storage
    from megatron.checkpointing.dist.model import Layout, load_weights, save_weights
    from megatron.checkpointing.errors import CheckpointError
    from megatron.core import parallel_state as ps
    config, model = _build(2, 2)
    saved = _gather_full_params(model)
    save_weights(model, directory, Layout.from_parallel_state(config.num_layers), False)
    saved_all = [None] * world
    torch.distributed.all_gather_object(saved_all, saved)
    reference = {k: v for d in saved_all for k, v in d.items() if k != "word_embeddings.weight"}
    results = {}
    for tp, pp, vpp in ((1, 1, None), (4, 1, None), (1, 4, None), (2, 2, 2), (1, 2, None)):
        ps.destroy_model_parallel()
        config, model = _build(tp, pp, vpp, seed=7)
        load_weights(model, directory, Layout.from_parallel_state(config.num_layers), False,
                     strictness="raise_all")
        mine = _gather_full_params(model)
        worst = 0.0
        for name, value in mine.items():
            ref = reference["language_model.embedding.word_embeddings.weight"] \
                if name == "word_embeddings.weight" else reference[name]
            worst = max(worst, float((value - ref).abs().max()))
        results[(tp, pp, vpp)] = worst
    # A flipped byte in one rank's file: every rank refuses it (whichever rank hashed it).
    bad = Path(directory + "_corrupt")
    if rank == 0:
        import shutil
        shutil.copytree(directory, bad)
        shard = bad / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 3] ^= 0x01
        shard.write_bytes(bytes(data))
    torch.distributed.barrier()
    try:
        load_weights(model, bad, Layout.from_parallel_state(config.num_layers), False)
        results["corrupt"] = "loaded"
    except CheckpointError as err:
        results["corrupt"] = str(err)
    if rank == 0:
        md = storage.read_metadata(Path(directory)).state_dict_metadata
        results["keys"] = {k: (tuple(v.size), len(v.chunks)) for k, v in md.items()
                           if hasattr(v, "size")}
    return results


def test_save_at_tp2_pp2_loads_at_every_layout(tmp_path):
    results = run_distributed(4, _save_then_load, str(tmp_path / "ckpt"))
    for rank_result in results:
        assert "__1_0.distcp: its sha256 differs" in rank_result.pop("corrupt")
        for layout, worst in rank_result.items():
            if layout != "keys":
                assert worst == 0.0, (layout, worst)
    keys = results[0]["keys"]
    # Megatron-Core's layer-stacked keys, one chunk per layer and TP rank.
    assert keys["decoder.layers.self_attention.linear_qkv.weight"] == ((8, 96, 32), 16)
    assert keys["decoder.layers.self_attention.linear_proj.weight"] == ((8, 32, 32), 16)
    assert keys["decoder.layers.mlp.linear_fc1.layer_norm_weight"] == ((8, 32), 8)
    assert keys["embedding.word_embeddings.weight"] == ((64, 32), 2)
    assert "output_layer.weight" not in keys  # tied: stage 0's embedding only
    gpt2 = json.loads((MCORE / "gpt2" / "keys.json").read_text())["torch_dist_metadata"]
    tensor_keys = {k for k, v in gpt2.items() if isinstance(v, dict)}
    assert set(keys) == tensor_keys
