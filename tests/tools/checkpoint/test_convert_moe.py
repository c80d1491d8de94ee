"""MoE checkpoints in tools/checkpoint/convert.py: a round trip over TP/PP layouts is bitwise,
and each routed expert's and the shared experts' SwiGLU fc1 is re-split as [gate_r; up_r] per
TP rank (Megatron-LM's layout), the router and the shared experts' gate whole on every rank."""

from __future__ import annotations

import torch

from tests.tools.checkpoint import helpers
from tools.checkpoint import convert

MOE = dict(normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
           swiglu=True, ffn_hidden_size=32, untie_embeddings_and_output_weights=True,
           num_moe_experts=4, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
           moe_shared_expert_gate=True)
LAYER = "language_model.encoder.layers.1.mlp."


def test_moe_round_trip_over_tp_and_pp_is_bitwise(tmp_path):
    model = helpers.gpt(**MOE)
    args = helpers.args_of(model, add_bias_linear=False, normalization="RMSNorm",
                           position_embedding_type="rope", swiglu=True, num_experts=4,
                           moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
                           moe_shared_expert_gate=True)
    helpers.save_single(tmp_path / "src", model, args)
    previous = tmp_path / "src"
    for i, (tp, pp) in enumerate([(2, 2), (2, 1), (1, 1)]):
        dst = tmp_path / f"step{i}"
        assert convert.main(["--model-type", "GPT", "--load-dir", str(previous), "--save-dir",
                             str(dst), "--target-tensor-parallel-size", str(tp),
                             "--target-pipeline-parallel-size", str(pp)]) == 0
        previous = dst
        if (tp, pp) == (2, 1):
            tp2 = {r: helpers.flat_model(sd) for r, sd in
                   helpers.shards(dst / "iter_0000007").items()}
    whole = helpers.flat_model(helpers.shards(tmp_path / "src" / "iter_0000007")[(0, 0)])
    back = helpers.flat_model(helpers.shards(previous / "iter_0000007")[(0, 0)])
    helpers.assert_same_tensors(whole, back)
    for fc1 in ("local_experts.3.dense_h_to_4h.weight", "shared_experts.dense_h_to_4h.weight"):
        gate, up = whole[LAYER + fc1].chunk(2)
        half = gate.size(0) // 2
        assert torch.equal(tp2[(0, 0)][LAYER + fc1], torch.cat([gate[:half], up[:half]]))
        assert torch.equal(tp2[(1, 0)][LAYER + fc1], torch.cat([gate[half:], up[half:]]))
    fc2 = LAYER + "local_experts.0.dense_4h_to_h.weight"
    assert torch.equal(tp2[(1, 0)][fc2], whole[fc2][:, 8:])
    for key in ("router.weight", "shared_experts.gate_weight"):
        assert torch.equal(tp2[(1, 0)][LAYER + key], whole[LAYER + key])

