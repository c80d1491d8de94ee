"""What we write is what Megatron-Core writes: Megatron-Core's TP=2 Llama checkpoint, loaded
into our model at TP=2 and saved again, has exactly its keys, global shapes and chunks
(``keys.json``) and its weights; where real Megatron-Core is installed (the venv that
``../shared/data/mcore/regen.sh`` builds, or ``MCORE_PYTHON``), its ``dist_checkpointing.load``
reads our checkpoint and gives the recorded logits."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from bench.launch import free_port
from tests.checkpointing.dist.test_mcore_fixtures import MCORE, _config
from tests.multiprocess import run_distributed

pytestmark = pytest.mark.skipif(not MCORE.is_dir(), reason=f"{MCORE} is not here")
MCORE_PYTHON = Path(os.environ.get("MCORE_PYTHON", "/tmp/mcore/venv/bin/python"))


def _load_and_resave(rank, world, out):
    from megatron.checkpointing.dist.model import Layout, load_weights, save_weights
    from megatron.core import parallel_state as ps
    from megatron.core.models.builder import build_model_stage
    from megatron.core.models.gpt import GPTModel
    ps.initialize_model_parallel(2, 1)
    config = _config("llama_rope10k")
    model = build_model_stage(GPTModel, config, parallel_output=False)
    layout = Layout.from_parallel_state(config.num_layers)
    load_weights([model], MCORE / "llama_rope10k_tp2" / "torch_dist", layout, True)
    save_weights([model], out, layout, True)


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ours") / "torch_dist"
    run_distributed(2, _load_and_resave, str(out))
    return out


def test_keys_shapes_and_chunks_are_megatron_cores(ours):
    from megatron.checkpointing.dist import storage
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    theirs = json.loads((MCORE / "llama_rope10k_tp2" / "keys.json").read_text())
    theirs = theirs["torch_dist_metadata"]
    mine = storage.read_metadata(ours).state_dict_metadata
    assert set(mine) == set(theirs)
    for key, md in mine.items():
        if isinstance(md, BytesStorageMetadata):
            assert theirs[key] == "bytes"
            continue
        chunks = sorted([list(c.offsets), list(c.sizes)] for c in md.chunks)
        assert list(md.size) == theirs[key]["global_shape"], key
        assert chunks == sorted(theirs[key]["chunks"]), key
    assert json.loads((ours / "metadata.json").read_text()) == \
        json.loads((MCORE / "llama_rope10k_tp2" / "torch_dist" / "metadata.json").read_text())
    reference = torch.load(MCORE / "llama_rope10k" / "state_dict.pt", weights_only=True)
    tensors = storage.read_plain_tensors(ours)
    assert torch.equal(tensors["output_layer.weight"], reference["output_layer.weight"])
    assert torch.equal(tensors["decoder.layers.mlp.linear_fc1.weight"][1],
                       reference["decoder.layers.1.mlp.linear_fc1.weight"])


@pytest.mark.skipif(not MCORE_PYTHON.is_file(),
                    reason=f"real Megatron-Core is not installed here ({MCORE_PYTHON}; build it "
                           "with ../shared/data/mcore/regen.sh or set MCORE_PYTHON)")
def test_real_megatron_core_loads_what_we_write(ours):
    script = Path(__file__).with_name("mcore_load_ours.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    done = subprocess.run([str(MCORE_PYTHON), str(script), str(MCORE), str(ours)],
                          capture_output=True, text=True, timeout=600, env=env,
                          cwd=str(MCORE))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["max_abs_diff"] < 1e-5


@pytest.mark.skipif(not MCORE_PYTHON.is_file(),
                    reason=f"real Megatron-Core is not installed here ({MCORE_PYTHON}; build it "
                           "with ../shared/data/mcore/regen.sh or set MCORE_PYTHON)")
def test_real_megatron_core_loads_our_bert(tmp_path):
    """A BERT checkpoint written by tools/checkpoint/convert.py loads into Megatron-Core's
    BertModel with no missing or unexpected key, and Megatron-Core saves it back with exactly
    our keys and tensors."""
    from megatron.checkpointing import checkpoint_dir
    from megatron.checkpointing.dist import storage
    from tests.tools.checkpoint import helpers
    from tools.checkpoint import convert
    model = helpers.bert(num_layers=2)
    helpers.save_single(tmp_path / "torch", model, helpers.args_of(model, num_tokentypes=2))
    assert convert.main(["--model-type", "BERT", "--load-dir", str(tmp_path / "torch"),
                         "--save-dir", str(tmp_path / "dist"),
                         "--target-ckpt-format", "torch_dist"]) == 0
    ours = checkpoint_dir(tmp_path / "dist", 7)
    script = Path(__file__).with_name("mcore_load_ours_bert.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(OMP_NUM_THREADS="1")
    done = subprocess.run([str(MCORE_PYTHON), str(script), str(MCORE), str(ours),
                           str(tmp_path / "theirs"), str(free_port())],
                          capture_output=True, text=True, timeout=600, env=env,
                          cwd=str(MCORE))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"missing": [], "unexpected": []}
    theirs = tmp_path / "theirs"
    keys = [set(storage.read_metadata(d).state_dict_metadata) for d in (ours, theirs)]
    assert keys[0] == keys[1], keys[0] ^ keys[1]
    mine, resaved = storage.read_plain_tensors(ours), storage.read_plain_tensors(theirs)
    assert mine.keys() == resaved.keys()
    for key, value in mine.items():
        assert torch.equal(value, resaved[key]), key
