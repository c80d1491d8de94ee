"""A one-rank run for the kill -9 test: saves iteration 1, then starts the asynchronous save of
iteration 2 whose write stalls after the shard file (before the tracker moves) and prints
STALLED; the test kills it there. Usage: python async_save_victim.py SAVE_DIR PORT"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main(save: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.checkpointing.dist import storage
    from megatron.checkpointing.dist.async_save import SAVER
    from megatron.checkpointing.dist.model import Layout, model_objects, model_tensors
    from megatron.checkpointing.files import publish_tracker
    from megatron.checkpointing.names import checkpoint_dir
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                               padded_vocab_size=32, max_position_embeddings=8)
    torch.manual_seed(0)
    model = [GPTModel(config, None)]
    layout = Layout(num_layers=2)

    def save_iteration(iteration: int, asynchronous: bool) -> None:
        directory = checkpoint_dir(save_root, iteration)
        objects = {storage.COMMON_STATE_KEY: {"iteration": iteration}}
        objects.update(model_objects(model, layout))
        state = storage.stage(model_tensors(model, layout, False, for_save=True), objects,
                              to_host=True)

        def publish(every):
            storage.finish(directory, every)
            publish_tracker(save_root, iteration, directory)

        SAVER.start(directory, state, True, publish)
        if not asynchronous:
            SAVER.wait()

    save_root = Path(save)
    save_iteration(1, asynchronous=False)
    with torch.no_grad():
        for p in model[0].parameters():
            p.add_(1.0)
    stalled = threading.Event()
    real_sha = storage._sha256

    def stall(path):
        digest = real_sha(path)
        stalled.set()
        time.sleep(3600)  # the shard is on disk, the tracker not yet moved
        return digest

    storage._sha256 = stall
    save_iteration(2, asynchronous=True)
    stalled.wait()
    print("STALLED", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(*sys.argv[1:])
