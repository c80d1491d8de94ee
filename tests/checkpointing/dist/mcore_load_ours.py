"""Run under real Megatron-Core (the venv ``../shared/data/mcore/regen.sh`` builds): load a
torch_dist checkpoint this project wrote into Megatron-Core's Llama-style GPTModel with
``dist_checkpointing.load`` and print its logits' largest difference from the recorded ones as
JSON. Usage: python mcore_load_ours.py MCORE_FIXTURES CHECKPOINT_DIR"""

import json
import os
import sys

import torch


def main(fixtures: str, checkpoint: str) -> None:
    sys.path.insert(0, fixtures)
    import gen  # the fixtures' generator: its CPU stand-ins, configs and forward

    gen.apply_cpu_workarounds()
    os.environ.setdefault("MASTER_PORT", sys.argv[3] if len(sys.argv) > 3 else "29534")
    gen.init_dist(1)
    from megatron.core import dist_checkpointing
    model = gen.build("llama_rope10k")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), checkpoint))
    logits = gen.run_forward(model, with_moe_aux=False)["logits"]
    expected = torch.load(os.path.join(fixtures, "llama_rope10k", "outputs.pt"))["logits"]
    print(json.dumps({"max_abs_diff": float((logits - expected).abs().max())}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
