"""tools/checkpoint: an HF model directory that is broken or disagrees with itself is refused
naming the file and the field (no raw JSON / safetensors / reshape error, nothing dropped
silently); NaN weights are imported with a warning; the export refuses a --true-vocab-size
past the embedding and reports a full disk naming the file and --save-dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.tools.checkpoint import helpers
from tools.checkpoint import convert

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
VOCAB = 64


def _hf(directory: Path) -> Path:
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=helpers.HIDDEN, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=helpers.HEADS, num_key_value_heads=2,
        max_position_embeddings=helpers.MAX_POSITIONS, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _import(src: Path, dst: Path, capsys) -> tuple[int, str]:
    code = convert.main(["--model-type", "GPT", "--loader", "hf", "--load-dir", str(src),
                         "--save-dir", str(dst)])
    return code, capsys.readouterr().err


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("field, value, said", [
    ("intermediate_size", 32, "intermediate_size = 32"),
    ("num_key_value_heads", 4, "num_key_value_heads x head_dim = 16")])
def test_a_config_field_disagreeing_with_the_tensors_is_named(tmp_path, capsys, field, value,
                                                              said):
    src = _hf(tmp_path / "hf")
    _edit_config(src, **{field: value})
    code, err = _import(src, tmp_path / "out", capsys)
    assert code == 2 and said in err and str(src / "config.json") in err, err
    assert "correct config.json" in err


def test_layers_beyond_num_hidden_layers_are_refused(tmp_path, capsys):
    src = _hf(tmp_path / "hf")
    _edit_config(src, num_hidden_layers=1)
    code, err = _import(src, tmp_path / "out", capsys)
    assert code == 2 and "layer(s) 1, beyond the num_hidden_layers 1" in err, err


def test_a_broken_config_json_is_named(tmp_path, capsys):
    src = _hf(tmp_path / "hf")
    text = (src / "config.json").read_text()
    (src / "config.json").write_text(text[: len(text) // 2])
    code, err = _import(src, tmp_path / "out", capsys)
    assert code == 2 and f"{src / 'config.json'} is not valid JSON" in err, err


@pytest.mark.parametrize("damage", ["truncate", "overwrite"])
def test_a_damaged_safetensors_header_is_named(tmp_path, capsys, damage):
    src = _hf(tmp_path / "hf")
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:6] if damage == "truncate" else b"\xff" * 64 + data[64:])
    code, err = _import(src, tmp_path / "out", capsys)
    assert code == 2 and f"cannot read {weights}" in err and "download it again" in err, err


def test_nan_weights_are_imported_with_a_warning(tmp_path, capsys, caplog):
    src = _hf(tmp_path / "hf")
    tensors = safetensors_torch.load_file(str(src / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][0, :3] = float("nan")
    safetensors_torch.save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("WARNING"):
        code, err = _import(src, tmp_path / "out", capsys)
    assert code == 0, err
    said = [r.getMessage() for r in caplog.records if "NaN/inf" in r.getMessage()]
    assert len(said) == 1 and "model.layers.1.mlp.up_proj.weight holds 3 NaN/inf" in said[0]


def test_true_vocab_size_past_the_embedding_is_refused(tmp_path, capsys):
    src = _hf(tmp_path / "hf")
    assert _import(src, tmp_path / "ours", capsys)[0] == 0
    code = convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / "ours"),
                         "--save-dir", str(tmp_path / "back"), "--saver", "hf",
                         "--true-vocab-size", "1000"])
    err = capsys.readouterr().err
    assert code == 2 and "--true-vocab-size 1000 must be between 1 and the checkpoint's 128" \
        in err, err


def test_a_full_disk_on_export_names_the_file_and_save_dir(tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    src = _hf(tmp_path / "hf")
    assert _import(src, tmp_path / "ours", capsys)[0] == 0

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: "
                              "StorageFull, message: \"No space left on device\" })")

    monkeypatch.setattr(safetensors_torch, "save_file", full)
    out = tmp_path / "back"
    code = convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / "ours"),
                         "--save-dir", str(out), "--saver", "hf"])
    err = capsys.readouterr().err
    assert code == 2 and "no space left on the device" in err and str(out) in err, err
    assert "--save-dir" in err and "needs about" in err
    assert not list(out.glob("*.tmp"))


def test_the_megatron_saver_names_save_dir_on_a_full_disk(tmp_path):
    import errno

    from megatron.checkpointing.files import write_error

    err = write_error(OSError(errno.ENOSPC, "No space left on device"),
                      tmp_path / "mp_rank_00" / "model_optim_rng.pt", 100, flag="--save-dir")
    assert "point --save-dir at a larger disk" in str(err)
