"""What a process pays at start-up: the trainer's and the tools' imports leave out TorchDynamo
and torch.distributed.checkpoint (seconds each), which only ``--compile-layers`` and
``--ckpt-format torch_dist`` need."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch._dynamo", "torch.distributed.checkpoint")


def test_the_entry_points_import_neither_dynamo_nor_dcp():
    script = ("import sys, pretrain_gpt, pretrain_bert, megatron.training.pretrain, "
              "megatron.core.transformer.moe.moe_layer, megatron.core.transformer.context_parallel;"
              f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_compiled_layer_marks_its_eager_regions():
    from megatron.core import eager_regions
    from megatron.core.transformer.config import TransformerConfig
    from megatron.core.transformer.layer import TransformerLayer

    TransformerLayer(TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                       compile_layers=True), 1, None)
    assert eager_regions._REGISTERED
    assert all(fn in eager_regions._EAGER for fn in eager_regions._REGISTERED)
