"""A Llama checkpoint written by real Megatron-LM core_v0.13's converter (``--loader
llama_mistral --saver legacy``, ``../shared/data/megatron_llama_v013``) loads with
``--load ckpt --use-checkpoint-args`` and the tokenizer flags, as a Megatron user runs it: HF's
fp32 logits to 1e-5 and HF's greedy tokens, at TP=1 and after tools/checkpoint/convert.py to
TP=2. The checkpoint holds Megatron's ``rerun_state_machine`` entry (enums read as data),
``add_position_embedding=True`` in a RoPE model's args, ``*_norm`` names and empty
``_extra_state`` entries."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.multiprocess import run_distributed

TOL = 1e-5
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def source(shared_data):
    root = shared_data / "megatron_llama_v013"
    if not root.is_dir():
        pytest.skip(f"{root} is absent")
    return root


def _flags(ckpt: str, hf: str) -> list[str]:
    return ["--load", ckpt, "--use-checkpoint-args", "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", hf, "--micro-batch-size", "1",
            "--distributed-backend", "gloo", "--use-cpu-initialization"]


def _run(rank: int, world_size: int, ckpt: str, hf: str, sequences: list[list[int]],
         prompts: list[list[int]]) -> dict:
    """Inside a pooled rank: load as the inference tools do, then every sequence's full logits
    (gathered over TP) and the greedy continuation of every prompt."""
    del rank, world_size
    from megatron.config.cli import parse_command_line
    from megatron.core import comm, parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron.text_generation import generate_tokens
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.inference import weights_only
    from megatron.training.initialize import build_tokenizer_from_config, initialize_from_config
    from megatron.training.models import gpt_model_from

    flags, parser = parse_command_line(_flags(ckpt, hf))
    cfg = initialize_from_config(weights_only(flags), parser)
    try:
        tokenizer = build_tokenizer_from_config(cfg)
        model = gpt_model_from(cfg, inference=True)
        load_checkpoint([model], None, None, cfg)
        model.eval()
        logits = []
        with torch.no_grad():
            for ids in sequences:
                out = model(torch.tensor([ids]), torch.arange(len(ids))[None], None)
                out = gather_from_tensor_model_parallel_region(
                    out, parallel_state.get_tensor_model_parallel_group())  # [1, s, V]
                logits.append(out[0, :, :tokenizer.vocab_size].clone())
        tokens = generate_tokens(model, prompts, NEW_TOKENS, eod=tokenizer.eod,
                                 vocab_size=tokenizer.vocab_size,
                                 max_sequence_length=cfg.model.max_position_embeddings,
                                 greedy=True, mp_group=comm.world_group(),
                                 pp_group=parallel_state.get_pipeline_model_parallel_group())
        return {"logits": logits, "tokens": tokens, "tp": cfg.parallel.tensor_model_parallel_size,
                "rope": cfg.model.position_embedding_type}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def tp2(source, tmp_path_factory):
    from tools.checkpoint import convert

    out = tmp_path_factory.mktemp("megatron_llama_v013") / "tp2"
    assert convert.main(["--model-type", "GPT", "--load-dir", str(source / "megatron_tp1"),
                         "--save-dir", str(out), "--target-tensor-parallel-size", "2"]) == 0
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_lm_llama_checkpoint_gives_hf_logits_and_greedy_tokens(source, tp, request):
    ckpt = source / "megatron_tp1" if tp == 1 else request.getfixturevalue("tp2")
    data = json.loads((source / "sequences.json").read_text())
    reference = np.load(source / "hf_reference.npz")
    results = run_distributed(tp, _run, str(ckpt), str(source / "hf"), data["sequences"],
                              data["prompts"])
    for out in results:
        assert (out["tp"], out["rope"]) == (tp, "rope")
        for i, logits in enumerate(out["logits"]):
            theirs = torch.from_numpy(reference[f"logits_{i}"])
            assert (logits - theirs).abs().max().item() <= TOL, i
        for i, tokens in enumerate(out["tokens"]):
            assert tokens == reference[f"gen_{i}"].tolist(), i
