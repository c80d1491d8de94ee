"""The MoE rows of the key table against Megatron-Core's MoE checkpoint: legacy-named tensors
(router, local experts, shared expert) cut from its global tensors map back onto exactly its
keys, global shapes and chunks (two expert-parallel ranks included), and the chunks rebuild its
tensors bitwise. No MoE model is built: plain tensors only."""

from __future__ import annotations

import json

import pytest
import torch

from megatron.checkpointing.dist import storage
from megatron.checkpointing.dist.keys import Placement, gpt_rules, model_chunks
from tests.checkpointing.dist.test_mcore_fixtures import MCORE

FIXTURE = MCORE / "moe_alltoall_shared"
pytestmark = pytest.mark.skipif(not FIXTURE.is_dir(), reason=f"{FIXTURE} is not here")


def _legacy_state(tensors, experts, ep_rank, ep_size):
    """Our names of one EP rank's tensors, cut from Megatron-Core's global ones."""
    local = experts // ep_size
    out = {}
    for rule in gpt_rules(swiglu=True):
        if rule.mcore not in tensors or rule.ours == "word_embeddings.weight":
            continue
        value = tensors[rule.mcore]
        if rule.stacked == 0:
            out[rule.ours] = value
        elif rule.stacked == 1:
            for layer in range(value.shape[0]):
                out[rule.ours.format(layer=layer)] = value[layer]
        else:
            for layer in range(value.shape[0]):
                for i in range(local):
                    out[rule.ours.format(layer=layer, expert=i)] = \
                        value[layer, ep_rank * local + i]
    return out


@pytest.mark.parametrize("ep_size", [1, 2])
def test_moe_rows_give_megatron_cores_keys_shapes_and_chunks(ep_size):
    tensors = storage.read_plain_tensors(FIXTURE / "torch_dist")
    theirs = json.loads((FIXTURE / "keys.json").read_text())["torch_dist_metadata"]
    experts = tensors["decoder.layers.mlp.router.weight"].shape[1]
    chunks: dict = {}
    for ep_rank in range(ep_size):
        state = _legacy_state(tensors, experts, ep_rank, ep_size)
        where = Placement(num_layers=2, num_experts=experts,
                          expert_offset=ep_rank * experts // ep_size)
        for key, found in model_chunks(state, gpt_rules(swiglu=True), where).items():
            chunks.setdefault(key, []).extend(found)
    assert set(chunks) == {k for k, v in theirs.items() if isinstance(v, dict)}
    for key, found in chunks.items():
        unique = {c.offset: c for c in found}
        assert list(found[0].global_shape) == theirs[key]["global_shape"], key
        assert sorted([list(o), list(c.data.shape)] for o, c in unique.items()) == \
            sorted(theirs[key]["chunks"]), key
        rebuilt = torch.empty(found[0].global_shape)
        for offset, c in unique.items():
            rebuilt[tuple(slice(o, o + n) for o, n in zip(offset, c.data.shape))] = c.data
        assert torch.equal(rebuilt, tensors[key]), key
