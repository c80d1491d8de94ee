"""Run under real Megatron-Core (the venv ``../shared/data/mcore/regen.sh`` builds): load a
BERT torch_dist checkpoint this project wrote into Megatron-Core's BertModel (local layer
spec, tied output layer, binary head) with ``dist_checkpointing.load``, then save it again with
``dist_checkpointing.save``; print the keys Megatron-Core's load found missing or unexpected
as JSON. Usage: python mcore_load_ours_bert.py MCORE_FIXTURES CHECKPOINT_DIR OUT_DIR PORT"""

import json
import os
import sys

import torch


def main(fixtures: str, checkpoint: str, out: str, port: str) -> None:
    sys.path.insert(0, fixtures)
    import gen  # the fixtures' generator: its CPU stand-ins and process group

    gen.apply_cpu_workarounds()
    os.environ["MASTER_PORT"] = port
    gen.init_dist(1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                               use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0)
    model = BertModel(config, num_tokentypes=2, transformer_layer_spec=bert_layer_local_spec,
                      vocab_size=264, max_sequence_length=32, parallel_output=False,
                      share_embeddings_and_output_weights=True, add_binary_head=True)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    state, missing, unexpected = dist_checkpointing.load(
        model.sharded_state_dict(), checkpoint, strict=StrictHandling.RETURN_ALL)
    own = model.state_dict()  # the common state (args, iteration...) merged in is not the model's
    model.load_state_dict({k: v for k, v in state.items() if k in own})
    os.makedirs(out, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), out)
    print(json.dumps({"missing": sorted(missing), "unexpected": sorted(unexpected)}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
