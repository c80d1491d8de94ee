"""Run under real Megatron-Core with torchrun (4 ranks): build the ``ep_base`` MoE GPT of
``tests/fixtures/mcore_moe`` at EP=2 x TP=2 (sequence parallel) with each expert
tensor-parallel size given, load the ``torch_dist`` checkpoint this project's training wrote at
that layout with ``dist_checkpointing.load`` into its ``sharded_state_dict`` (nested under
``model`` as Megatron-LM's training saves it), and save the gathered eval logits on the
fixture's inputs, by ETP.
Usage: torchrun --nproc_per_node 4 mcore_load_our_moe.py OUT.pt ETP CHECKPOINT_ITER_DIR [...]"""

import pathlib
import sys

import torch
import torch.distributed as dist

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "mcore_moe"


def main(out: str, pairs: list[str]) -> None:
    sys.path.insert(0, str(FIXTURES))
    import gen_mcore_moe as gen  # the fixtures' generator: its stand-ins, model and forward

    gen._shared_workarounds()
    gen._ep_split_sizes_on_cpu()
    gen._torch_norm_with_sequence_parallel()
    gen._uneven_collectives_over_gloo()
    dist.init_process_group("gloo")
    results = {}
    for etp, checkpoint in zip(pairs[::2], pairs[1::2]):
        results[int(etp)] = _logits(gen, int(etp), checkpoint)
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def _logits(gen, etp: int, checkpoint: str) -> dict:
    from megatron.core import dist_checkpointing
    gen._init(2, 2, etp)
    model = gen.build(dict(gen.MODELS["ep_base"], tensor_model_parallel_size=2,
                           expert_model_parallel_size=2, expert_tensor_parallel_size=etp,
                           sequence_parallel=True))
    with torch.no_grad():  # the load must replace every weight
        for p in model.parameters():
            p.fill_(0.5)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, checkpoint)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing
    assert not unexpected, unexpected
    model.eval()
    with torch.no_grad():
        logits = gen._full_logits(model, gen.inputs())
    return {"logits": logits, "iteration": state.get("iteration")}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
