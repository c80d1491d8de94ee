"""MoE models in ``--ckpt-format torch_dist``: Megatron-Core 0.19.2's MoE checkpoint
(``moe_alltoall_shared``: 4 experts, top-2, a shared expert) loads into our MoE model under the
legacy names at TP=1 and TP=2 and gives its recorded logits; what we save has its keys, global
shapes, chunks and ``_extra_state`` objects, and loads back bitwise. The same checkpoint loads
by ``--load DIR --ckpt-format torch_dist`` with the model's pretrain_gpt.py flags (a bare
directory: its weights as a release)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron.checkpointing.dist.model import Layout
from tests.checkpointing.dist.test_mcore_fixtures import MCORE, TOL
from tests.multiprocess import run_distributed

FIXTURE = MCORE / "moe_alltoall_shared"
pytestmark = pytest.mark.skipif(not FIXTURE.is_dir(), reason=f"{FIXTURE} is not here")


def _config(tp: int):
    from megatron.core.transformer.config import TransformerConfig
    return TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        num_query_groups=2, padded_vocab_size=128, max_position_embeddings=32,
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        add_position_embedding=False, add_bias_linear=False,
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_gelu_fusion=False, num_moe_experts=4, moe_ffn_hidden_size=96,
        moe_shared_expert_intermediate_size=64, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3, moe_token_dispatcher_type="alltoall",
        sequence_parallel=tp > 1)


def _load_logits_and_resave(rank, world, tp, out):
    from megatron.checkpointing.dist import storage
    from megatron.checkpointing.dist.model import load_weights, save_weights
    from megatron.core import parallel_state as ps
    from megatron.core.models.builder import build_model_stage
    from megatron.core.models.gpt import GPTModel
    from tests.training.e2e import _gather_full_params
    ps.initialize_model_parallel(tp, 1)
    config = _config(tp)
    torch.manual_seed(99)  # other weights than Megatron-Core's: the load must replace them
    model = build_model_stage(GPTModel, config, parallel_output=False)
    layout = Layout.from_parallel_state(config.num_layers, config.num_moe_experts)
    load_weights([model], FIXTURE / "torch_dist", layout, True, strictness="raise_all")
    inputs = torch.load(FIXTURE / "outputs.pt", weights_only=True)
    model.eval()
    with torch.no_grad():
        logits = model(inputs["input_ids"], inputs["position_ids"].expand(2, -1),
                       inputs["attention_mask"])
    loaded = _gather_full_params([model])
    save_weights([model], out, layout, True)
    torch.manual_seed(5)
    again = build_model_stage(GPTModel, config, parallel_output=False)
    load_weights([again], out, layout, True, strictness="raise_all")
    back = _gather_full_params([again])
    same = all(torch.equal(loaded[k], back[k]) for k in loaded)
    keys = None
    if rank == 0:
        md = storage.read_metadata(Path(out)).state_dict_metadata
        keys = {k: ("bytes" if not hasattr(v, "size") else
                    (list(v.size), sorted([list(c.offsets), list(c.sizes)] for c in v.chunks)))
                for k, v in md.items()}
    return logits, same, keys


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_core_moe_checkpoint_gives_its_logits_and_resaves_as_its_keys(tp, tmp_path):
    expected = torch.load(FIXTURE / "outputs.pt", weights_only=True)["logits"]
    results = run_distributed(tp, _load_logits_and_resave, tp, str(tmp_path / "ours"))
    for logits, same, _ in results:
        assert (logits - expected).abs().max().item() < TOL
        assert same
    theirs = json.loads((FIXTURE / "keys.json").read_text())["torch_dist_metadata"]
    mine = results[0][2]
    assert set(mine) == set(theirs)
    for key, value in theirs.items():
        if value == "bytes":
            assert mine[key] == "bytes", key
        elif tp == 1:
            assert mine[key] == (value["global_shape"], sorted(value["chunks"])), key
        else:
            assert mine[key][0] == value["global_shape"], key


# The fixture's model as pretrain_gpt.py flags (tests/core/transformer/test_moe_mcore.py maps
# its TransformerConfig onto ours).
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "128",
         "--seq-length", "32", "--max-position-embeddings", "32",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
         "--make-vocab-size-divisible-by", "64", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--num-experts", "4",
         "--moe-ffn-hidden-size", "96", "--moe-shared-expert-intermediate-size", "64",
         "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
         "--moe-token-dispatcher-type", "alltoall", "--micro-batch-size", "1",
         "--train-iters", "1", "--lr", "1e-4", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--use-cpu-initialization", "--distributed-backend", "gloo"]


def _load_by_flags(rank, world, tp):
    import pretrain_gpt
    from megatron.config.cli import build_parser, parse_flags
    from megatron.config.validate import validate
    from megatron.core import parallel_state as ps
    from megatron.training.checkpointing import load_checkpoint
    argv = [*FLAGS, "--tensor-model-parallel-size", str(tp), "--load", str(FIXTURE / "torch_dist"),
            "--ckpt-format", "torch_dist"] + (["--sequence-parallel"] if tp > 1 else [])
    cfg = validate(parse_flags(build_parser(), argv), world_size=world)
    ps.initialize_model_parallel(tp, 1)
    torch.manual_seed(99)
    model = pretrain_gpt.model_provider(cfg).eval()
    iteration, _, _ = load_checkpoint([model], None, None, cfg)
    inputs = torch.load(FIXTURE / "outputs.pt", weights_only=True)
    with torch.no_grad():
        logits = model(inputs["input_ids"], inputs["position_ids"].expand(2, -1),
                       inputs["attention_mask"])
    if tp > 1:  # the training model's logits are vocabulary-parallel
        parts = [torch.empty_like(logits) for _ in range(tp)]
        torch.distributed.all_gather(parts, logits.contiguous())
        logits = torch.cat(parts, dim=-1)
    return iteration, logits


@pytest.mark.parametrize("tp", [1, 2])
def test_load_by_flags_gives_the_recorded_logits(tp):
    expected = torch.load(FIXTURE / "outputs.pt", weights_only=True)["logits"]
    for iteration, logits in run_distributed(tp, _load_by_flags, tp):
        assert iteration == 0  # a bare directory: weights only
        assert (logits - expected).abs().max().item() < TOL
