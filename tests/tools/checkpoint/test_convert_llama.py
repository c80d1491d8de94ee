"""Llama-style checkpoints in tools/checkpoint/convert.py: round trips over TP/PP
layouts (RMSNorm, RoPE, GQA, SwiGLU's fc1 re-split as [gate_r; up_r] per rank), and a target
TP size that does not divide the query groups refused, naming the flag; the Adam moments of a
SwiGLU + GQA model split over TP as its weights."""

from __future__ import annotations

import argparse

import pytest
import torch

from tools.checkpoint.convert import refuse_unconverted_architecture


class _Described:
    def __init__(self, **args):
        self.args = argparse.Namespace(**args)


def _opts(saver: str, tp: int = 1) -> argparse.Namespace:
    return argparse.Namespace(saver=saver, target_tensor_parallel_size=tp)


def test_hf_export_checks_its_own_class():
    """--saver hf refuses in the saver (hf_llama / hf_mapping), which knows the target class."""
    refuse_unconverted_architecture(_Described(swiglu=True, normalization="RMSNorm"),
                                    _opts("hf"))


def test_query_groups_split_over_the_target_tp():
    md = _Described(group_query_attention=True, num_query_groups=2,
                    tensor_model_parallel_size=2)
    refuse_unconverted_architecture(md, _opts("megatron", tp=1))  # whole groups concatenate
    with pytest.raises(ValueError, match="--num-query-groups 2"):
        refuse_unconverted_architecture(md, _opts("megatron", tp=4))


def test_gpt2_checkpoints_pass():
    refuse_unconverted_architecture(_Described(tensor_model_parallel_size=1), _opts("hf"))


def test_llama_round_trip_over_tp_and_pp_is_bitwise(tmp_path):
    """RMSNorm (no norm biases), RoPE, GQA (whole groups per TP rank), no linear biases: the
    generic re-split is right for these; SwiGLU's fc1 is re-split per rank."""
    from tests.tools.checkpoint import helpers
    from tools.checkpoint import convert

    llama = dict(normalization="RMSNorm", position_embedding_type="rope", num_query_groups=2,
                 add_bias_linear=False, swiglu=True, ffn_hidden_size=32,
                 untie_embeddings_and_output_weights=True)
    model = helpers.gpt(**llama)
    args = helpers.args_of(model, add_bias_linear=False, normalization="RMSNorm",
                           position_embedding_type="rope", swiglu=True,
                           group_query_attention=True, num_query_groups=2)
    helpers.save_single(tmp_path / "src", model, args)
    previous = tmp_path / "src"
    for i, (tp, pp) in enumerate([(1, 2), (2, 2), (2, 1), (1, 4), (1, 1)]):
        dst = tmp_path / f"step{i}"
        assert convert.main(["--model-type", "GPT", "--load-dir", str(previous), "--save-dir",
                             str(dst), "--target-tensor-parallel-size", str(tp),
                             "--target-pipeline-parallel-size", str(pp)]) == 0
        previous = dst
    source = helpers.shards(tmp_path / "src" / "iter_0000007")[(0, 0)]
    back = helpers.shards(previous / "iter_0000007")[(0, 0)]
    helpers.assert_same_tensors(helpers.flat_model(source), helpers.flat_model(back))
    # Without SwiGLU the TP re-split runs too: whole key/value groups per rank.
    gqa = {**llama, "swiglu": False, "ffn_hidden_size": 64}
    model = helpers.gpt(**gqa)
    args.swiglu, args.ffn_hidden_size = False, 64
    helpers.save_single(tmp_path / "gqa", model, args)
    assert convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / "gqa"),
                         "--save-dir", str(tmp_path / "gqa_tp2"),
                         "--target-tensor-parallel-size", "2"]) == 0
    tp2 = helpers.shards(tmp_path / "gqa_tp2" / "iter_0000007")
    qkv = "language_model.encoder.layers.0.self_attention.query_key_value.weight"
    whole = helpers.flat_model(helpers.shards(tmp_path / "gqa" / "iter_0000007")[(0, 0)])[qkv]
    rows = whole.size(0) // 2  # group 0 ([2 q + k + v] x hn rows) on rank 0, group 1 on rank 1
    assert torch.equal(helpers.flat_model(tp2[(0, 0)])[qkv], whole[:rows])
    assert torch.equal(helpers.flat_model(tp2[(1, 0)])[qkv], whole[rows:])


def test_swiglu_fc1_shards_are_gate_r_up_r(tmp_path):
    """TP 1 -> 2 -> 1 is bitwise, and rank r's fc1 is [gate_r; up_r] as Megatron stores it
    (its MLP chunks the local output in halves)."""
    from tests.tools.checkpoint import helpers
    from tools.checkpoint import convert

    model = helpers.gpt(swiglu=True, ffn_hidden_size=32, add_bias_linear=True)
    args = helpers.args_of(model, swiglu=True, ffn_hidden_size=32)
    helpers.save_single(tmp_path / "src", model, args)
    for src, dst, tp in (("src", "tp2", "2"), ("tp2", "tp1", "1")):
        assert convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / src),
                             "--save-dir", str(tmp_path / dst),
                             "--target-tensor-parallel-size", tp]) == 0
    source = helpers.flat_model(helpers.shards(tmp_path / "src" / "iter_0000007")[(0, 0)])
    back = helpers.flat_model(helpers.shards(tmp_path / "tp1" / "iter_0000007")[(0, 0)])
    helpers.assert_same_tensors(source, back)
    tp2 = helpers.shards(tmp_path / "tp2" / "iter_0000007")
    for name in ("weight", "bias"):
        key = f"language_model.encoder.layers.1.mlp.dense_h_to_4h.{name}"
        gate, up = torch.chunk(source[key], 2, dim=0)
        for rank in range(2):
            expected = torch.cat([torch.chunk(gate, 2)[rank], torch.chunk(up, 2)[rank]])
            assert torch.equal(helpers.flat_model(tp2[(rank, 0)])[key], expected)


def test_qk_layernorm_round_trip_is_bitwise(tmp_path):
    """--qk-layernorm's q/k norms (Megatron core's names) are whole on every TP rank and
    survive TP/PP changes bitwise; LayerNorm's bias too."""
    from tests.tools.checkpoint import helpers
    from tools.checkpoint import convert

    model = helpers.gpt(qk_layernorm=True, num_query_groups=2)
    with torch.no_grad():  # away from the ones/zeros init, so a mix-up would show
        for name, p in model.named_parameters():
            if "_layernorm" in name:
                p.add_(torch.randn(p.shape, dtype=p.dtype, device=p.device))
    args = helpers.args_of(model, qk_layernorm=True, group_query_attention=True,
                           num_query_groups=2)
    helpers.save_single(tmp_path / "src", model, args)
    previous = tmp_path / "src"
    for i, (tp, pp) in enumerate([(2, 2), (1, 1)]):
        dst = tmp_path / f"step{i}"
        assert convert.main(["--model-type", "GPT", "--load-dir", str(previous), "--save-dir",
                             str(dst), "--target-tensor-parallel-size", str(tp),
                             "--target-pipeline-parallel-size", str(pp)]) == 0
        previous = dst
    source = helpers.flat_model(helpers.shards(tmp_path / "src" / "iter_0000007")[(0, 0)])
    back = helpers.flat_model(helpers.shards(previous / "iter_0000007")[(0, 0)])
    helpers.assert_same_tensors(source, back)
    key = "language_model.encoder.layers.0.self_attention.{}_layernorm.{}"
    assert all(key.format(n, w) in source for n in "qk" for w in ("weight", "bias"))
    tp2 = helpers.shards(tmp_path / "step0" / "iter_0000007")
    for rank in range(2):
        shard = helpers.flat_model(tp2[(rank, 0)])
        assert torch.equal(shard[key.format("k", "weight")], source[key.format("k", "weight")])


def _adam_state_by_key(sd: dict) -> dict[str, dict[str, torch.Tensor]]:
    """A plain fp32 shard's Adam moments under the model keys (the torch optimizer's state
    indices follow Megatron's param groups: tests/tools/checkpoint/test_optimizer_state.py)."""
    from tests.tools.checkpoint import helpers
    from tools.checkpoint.optimizer_state import param_groups

    members = [key for _, group in param_groups([helpers.flat_model(sd)]) for _, key in group]
    state = sd["optimizer"]["state"]
    return {name: {key: state[i][name] for i, key in enumerate(members)}
            for name in ("exp_avg", "exp_avg_sq")}


def test_swiglu_and_gqa_optimizer_state_is_split_as_the_weights(tmp_path):
    """--keep-optimizer-state, TP 1 -> 2: rank r's Adam moments of fc1 are [gate_r; up_r] of
    the whole moments and those of QKV its whole query group r, as the weights. (Resuming
    training from such a conversion: tests/tools/checkpoint/test_convert_training.py.)"""
    from megatron.checkpointing import checkpoint_dir, checkpoint_name, publish_tracker, save_file
    from megatron.core.optimizer import get_param_groups
    from tests.tools.checkpoint import helpers
    from tools.checkpoint import convert

    model = helpers.gpt(num_layers=2, normalization="RMSNorm", position_embedding_type="rope",
                        num_query_groups=2, add_bias_linear=False, swiglu=True,
                        ffn_hidden_size=32, untie_embeddings_and_output_weights=True).train()
    adam = torch.optim.Adam(get_param_groups([model], weight_decay=0.1), lr=1e-3)
    ids = torch.randint(0, 200, (2, 8))
    positions = torch.arange(8).unsqueeze(0).expand_as(ids)
    for _ in range(2):  # two steps: exp_avg and exp_avg_sq no longer proportional to one grad
        adam.zero_grad()
        model(ids, positions).square().mean().backward()
        adam.step()
    args = helpers.args_of(model, add_bias_linear=False, normalization="RMSNorm",
                           position_embedding_type="rope", swiglu=True, optimizer="adam",
                           group_query_attention=True, num_query_groups=2)
    sd = {"args": args, "checkpoint_version": 3.0, "iteration": 7,
          "model": model.state_dict_for_save_checkpoint(), "optimizer": adam.state_dict()}
    save_file(sd, checkpoint_name(tmp_path / "src", 7))
    publish_tracker(tmp_path / "src", 7, checkpoint_dir(tmp_path / "src", 7))
    assert convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / "src"),
                         "--save-dir", str(tmp_path / "tp2"), "--target-tensor-parallel-size",
                         "2", "--keep-optimizer-state"]) == 0
    whole = _adam_state_by_key(helpers.shards(tmp_path / "src" / "iter_0000007")[(0, 0)])
    ranks = [_adam_state_by_key(shard) for _, shard in
             sorted(helpers.shards(tmp_path / "tp2" / "iter_0000007").items())]
    fc1 = "language_model.encoder.layers.1.mlp.dense_h_to_4h.weight"
    qkv = "language_model.encoder.layers.1.self_attention.query_key_value.weight"
    for name in ("exp_avg", "exp_avg_sq"):
        gate, up = torch.chunk(whole[name][fc1], 2, dim=0)
        groups = torch.chunk(whole[name][qkv], 2, dim=0)  # [G=2, np/G + 2, hn] rows
        for rank, state in enumerate(ranks):
            expected = torch.cat([torch.chunk(gate, 2)[rank], torch.chunk(up, 2)[rank]])
            assert torch.equal(state[name][fc1], expected), (name, rank)
            assert torch.equal(state[name][qkv], groups[rank]), (name, rank)
