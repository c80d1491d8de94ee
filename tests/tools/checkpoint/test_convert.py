"""tools/checkpoint/convert.py between Megatron layouts, without process groups: bitwise round
trips (GPT tied/untied, BERT), the target's shards against the layout table, args and
iteration carried over, the vocabulary re-padded, checkpoints other tools wrote, refused input,
and the command line."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron.checkpointing import (DISTRIB_OPTIM_FILENAME, CheckpointError, checkpoint_name,
                                    qkv_from_current_order, save_file, shard_files,
                                    tracker_path)
from tests.tools.checkpoint import helpers
from tools.checkpoint import convert, loader_megatron

ROOT = Path(__file__).resolve().parents[3]


def _convert(src: Path, dst: Path, *flags: str, model_type: str = "GPT") -> Path:
    assert convert.main(["--model-type", model_type, "--load-dir", str(src), "--save-dir",
                         str(dst), *flags]) == 0
    return dst


def _layout(tp: int, pp: int, vpp: int | None = None) -> list[str]:
    flags = ["--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp)]
    return flags + (["--target-num-layers-per-virtual-pipeline-stage", str(vpp)] if vpp else [])


@pytest.mark.parametrize("untied", [False, True])
def test_gpt_round_trip_over_every_layout_is_bitwise(tmp_path, untied):
    model = helpers.gpt(untie_embeddings_and_output_weights=untied)
    helpers.save_single(tmp_path / "src", model, helpers.args_of(model))
    previous = tmp_path / "src"
    for i, layout in enumerate([_layout(2, 2, 1), _layout(1, 4), _layout(4, 1), _layout(1, 1)]):
        previous = _convert(previous, tmp_path / f"step{i}", *layout)
    source = helpers.shards(tmp_path / "src" / "iter_0000007")[(0, 0)]
    back = helpers.shards(previous / "iter_0000007")[(0, 0)]
    helpers.assert_same_tensors(helpers.flat_model(source), helpers.flat_model(back))
    assert back["iteration"] == 7 and back["args"].consumed_train_samples == 56
    assert "optimizer" not in back  # dropped, as Megatron-LM's converter does


def test_tp2_pp2_virtual_stages_follow_the_layout_table(tmp_path):
    model = helpers.gpt()
    helpers.save_single(tmp_path / "src", model, helpers.args_of(model))
    out = _convert(tmp_path / "src", tmp_path / "dst", *_layout(2, 2, 1))
    shards = helpers.shards(out / "iter_0000007")
    assert sorted(shards) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert "mp_rank_01_001/model_optim_rng.pt" in \
        (out / "iter_0000007" / "checksums.sha256").read_text()
    full = model.state_dict()
    args = shards[(1, 1)]["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.num_layers_per_virtual_pipeline_stage,
            args.virtual_pipeline_model_parallel_size) == (2, 2, 1, 2)
    # The padding multiple is unchanged (8 x TP1 = 4 x TP2): a run passing
    # --make-vocab-size-divisible-by 4 at TP2 pads to the checkpoint's 264.
    assert args.make_vocab_size_divisible_by == 4 and args.padded_vocab_size == 264
    # Stage 1, model1 = layer 3 (Megatron's interleaved offsets), rows 32..63 of TP rank 1.
    stage1 = helpers.flat_model(shards[(1, 1)], "model1")
    qkv = "language_model.encoder.layers.0.self_attention.query_key_value.weight"
    assert torch.equal(stage1[qkv], full[qkv.replace("layers.0", "layers.3")].chunk(2)[1])
    dense = "language_model.encoder.layers.0.self_attention.dense.weight"
    assert torch.equal(stage1[dense],
                       full[dense.replace("layers.0", "layers.3")].chunk(2, dim=1)[1])
    embedding = full["language_model.embedding.word_embeddings.weight"]
    assert torch.equal(stage1["word_embeddings_for_head.weight"], embedding.chunk(2)[1])
    assert "language_model.embedding.word_embeddings.weight" in \
        helpers.flat_model(shards[(0, 0)], "model0")


def test_bert_round_trip_and_layout(tmp_path):
    model = helpers.bert()
    args = helpers.args_of(model, bert_binary_head=True)
    helpers.save_single(tmp_path / "src", model, args)
    out = _convert(tmp_path / "src", tmp_path / "tp2pp2", *_layout(2, 2), model_type="BERT")
    shards = helpers.shards(out / "iter_0000007")
    full = model.state_dict()
    last = helpers.flat_model(shards[(1, 1)])
    assert torch.equal(last["lm_head.bias"], full["lm_head.bias"].chunk(2)[1])
    for key in ("lm_head.dense.weight", "lm_head.layernorm.bias", "binary_head.weight",
                "language_model.pooler.dense.weight"):
        assert torch.equal(last[key], full[key]), key
    first = helpers.flat_model(shards[(0, 0)])
    assert torch.equal(first["language_model.embedding.tokentype_embeddings.weight"],
                       full["language_model.embedding.tokentype_embeddings.weight"])
    back = _convert(out, tmp_path / "back", model_type="BERT")
    restored = helpers.bert(seed=99)
    restored.load_state_dict(helpers.shards(back / "iter_0000007")[(0, 0)]["model"])
    tokens = torch.randint(0, 255, (2, 12))
    padding = torch.ones(2, 12, dtype=torch.long)
    types_ = torch.zeros(2, 12, dtype=torch.long)
    with torch.no_grad():
        expected, got = model(tokens, padding, types_), restored(tokens, padding, types_)
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])


def test_target_vocab_size_divisible_by_repads_the_vocabulary(tmp_path):
    model = helpers.gpt()
    helpers.save_single(tmp_path / "src", model, helpers.args_of(model))
    out = _convert(tmp_path / "src", tmp_path / "dst", "--target-vocab-size-divisible-by", "128",
                   "--true-vocab-size", "256", *_layout(2, 1))
    shards = helpers.shards(out / "iter_0000007")
    assert shards[(0, 0)]["args"].padded_vocab_size == 256  # 256 rounded to 128 x 2
    rows = torch.cat([helpers.flat_model(shards[(t, 0)])[
        "language_model.embedding.word_embeddings.weight"] for t in range(2)])
    assert torch.equal(rows, model.state_dict()[
        "language_model.embedding.word_embeddings.weight"][:256])


def test_padding_rows_copy_the_last_row(tmp_path):
    """Rows a re-padding adds are copies of the source's last row, as Megatron-LM pads."""
    model = helpers.gpt(untie_embeddings_and_output_weights=True)
    helpers.save_single(tmp_path / "src", model, helpers.args_of(model))
    out = _convert(tmp_path / "src", tmp_path / "dst", "--target-vocab-size-divisible-by", "128",
                   "--true-vocab-size", "264", *_layout(2, 1))
    shards = helpers.shards(out / "iter_0000007")
    assert shards[(0, 0)]["args"].padded_vocab_size == 512  # 264 rounded to 128 x 2
    for key in ("language_model.embedding.word_embeddings.weight",
                "language_model.output_layer.weight"):
        rows = torch.cat([helpers.flat_model(shards[(t, 0)])[key] for t in range(2)])
        source = model.state_dict()[key]
        assert torch.equal(rows[:264], source), key
        assert torch.equal(rows[264:], source[-1].expand(512 - 264, -1)), key


# Checkpoints other tools wrote --------------------------------------------------------------
def test_simple_namespace_args_and_a_tolerated_extra_key(tmp_path):
    model = helpers.gpt()
    args = types.SimpleNamespace(**vars(helpers.args_of(model)))
    extra = model.state_dict_for_save_checkpoint()
    extra["word_embeddings"] = {"weight": torch.zeros(3, 3)}  # beside the head, one stage
    sd = {"args": args, "checkpoint_version": 3.0, "iteration": 7, "model": extra}
    save_file(sd, checkpoint_name(tmp_path / "src", 7))
    tracker_path(tmp_path / "src").write_text("7")
    out = _convert(tmp_path / "src", tmp_path / "dst", *_layout(2, 1))
    shard = helpers.shards(out / "iter_0000007")[(0, 0)]
    assert isinstance(shard["args"], argparse.Namespace)
    assert "word_embeddings.weight" not in helpers.flat_model(shard)


@pytest.mark.parametrize("version", [0, 1.0, None])
def test_old_checkpoint_versions_are_converted_to_the_current_qkv_order(tmp_path, version):
    model = helpers.gpt()
    state = model.state_dict_for_save_checkpoint()
    encoder = state["language_model"]["encoder"]
    for key in [k for k in encoder if "query_key_value" in k]:
        encoder[key] = qkv_from_current_order(encoder[key], 3, helpers.HEADS, version or 0.0)
    sd = {"args": helpers.args_of(model), "iteration": 7, "model": state}
    if version is not None:
        sd["checkpoint_version"] = version
    save_file(sd, checkpoint_name(tmp_path / "src", 7))
    tracker_path(tmp_path / "src").write_text("7")
    out = _convert(tmp_path / "src", tmp_path / "dst")
    converted = helpers.shards(out / "iter_0000007")[(0, 0)]
    assert converted["checkpoint_version"] == 3.0
    helpers.assert_same_tensors(helpers.flat_model(converted),
                                helpers.flatten(model.state_dict_for_save_checkpoint()))


def test_release_directory_and_distrib_optim_file(tmp_path):
    model = helpers.gpt()
    sd = {"args": helpers.args_of(model), "checkpoint_version": 3.0,
          "model": model.state_dict_for_save_checkpoint()}
    save_file(sd, checkpoint_name(tmp_path / "src", 0, release=True))
    # Megatron's distributed-optimizer file beside the model file is not a model shard.
    save_file({"param_state": torch.zeros(4)},
              checkpoint_name(tmp_path / "src", 0, release=True).with_name(
                  DISTRIB_OPTIM_FILENAME))
    tracker_path(tmp_path / "src").write_text("release")
    out = _convert(tmp_path / "src", tmp_path / "dst", *_layout(1, 2))
    assert tracker_path(tmp_path / "dst").read_text() == "release"
    assert sorted(helpers.shards(out / "release")) == [(0, 0), (0, 1)]
    # An iteration directory given directly works too.
    direct = loader_megatron.load(tmp_path / "src" / "release", "GPT")
    assert direct.release and direct.num_layers == 4


# Refused input ---------------------------------------------------------------------------------
@pytest.fixture()
def tp2_checkpoint(tmp_path) -> Path:
    model = helpers.gpt()
    helpers.save_single(tmp_path / "src", model, helpers.args_of(model))
    return _convert(tmp_path / "src", tmp_path / "tp2", *_layout(2, 2))


def _refused(src: Path, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        loader_md = loader_megatron.load(src, "GPT")
        for i in range(loader_md.num_layers):
            loader_md.layer(i)
        loader_md.head()


def test_truncated_shard_is_refused_naming_the_file(tp2_checkpoint):
    shard = tp2_checkpoint / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    (shard.parents[1] / "checksums.sha256").unlink()  # as Megatron-LM writes it: none
    _refused(tp2_checkpoint, "corrupt or truncated checkpoint file .*mp_rank_01_001")


def test_corrupted_shard_fails_its_checksum(tp2_checkpoint):
    shard = tp2_checkpoint / "iter_0000007" / "mp_rank_00_001" / "model_optim_rng.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _refused(tp2_checkpoint, "mp_rank_00_001.*sha256")


def test_rank_directories_hold_only_megatrons_files(tp2_checkpoint):
    """HuggingFace's reshaping script loads the first entry it lists in each mp_rank directory:
    it must be the shard (the checksums are in the iteration directory)."""
    iteration_dir = tp2_checkpoint / "iter_0000007"
    for rank_dir in sorted(iteration_dir.glob("mp_rank_*")):
        entries = os.listdir(rank_dir)
        assert entries == ["model_optim_rng.pt"], entries
        sd = torch.load(rank_dir / entries[0], map_location="cpu", weights_only=False)
        assert isinstance(sd["model"], dict) and sd["args"].tensor_model_parallel_size == 2
    assert sorted(os.listdir(iteration_dir)) == [
        "checksums.sha256", "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
        "mp_rank_01_001"]


def test_missing_rank_directory_is_named(tp2_checkpoint):
    for entry in (tp2_checkpoint / "iter_0000007" / "mp_rank_01_000").iterdir():
        entry.unlink()
    (tp2_checkpoint / "iter_0000007" / "mp_rank_01_000").rmdir()
    _refused(tp2_checkpoint, "lacks the shard directory mp_rank_01_000")


def _remove_shard_dir(iteration_dir: Path, name: str) -> None:
    for entry in (iteration_dir / name).iterdir():
        entry.unlink()
    (iteration_dir / name).rmdir()


def _partial_tp2(root: Path) -> Path:
    """A TP=2 checkpoint without mp_rank_01: the directory alone looks like a whole TP=1 one."""
    out = _convert(root / "src", root / "tp2", *_layout(2, 1))
    _remove_shard_dir(out / "iter_0000007", "mp_rank_01")
    return out


def _partial_pp2(root: Path) -> Path:
    """A PP=2 checkpoint without its second stage."""
    out = _convert(root / "src", root / "pp2", *_layout(1, 2))
    _remove_shard_dir(out / "iter_0000007", "mp_rank_00_001")
    return out


def _vpp_unrecorded(root: Path) -> Path:
    """A PP=2 checkpoint with 2 virtual stages whose args lost them."""
    out = _convert(root / "src", root / "vpp", *_layout(1, 2, 1))
    for path in shard_files(out / "iter_0000007").values():
        sd = helpers.load_checkpoint_file(path)
        sd["args"].virtual_pipeline_model_parallel_size = None
        save_file(sd, path)
    return out


@pytest.mark.parametrize("case", [
    ("GPT", _partial_tp2, (), r"lacks the shard directory mp_rank_01 \(a TP 2 x PP 1"),
    ("GPT", _partial_tp2, _layout(2, 1), r"lacks the shard directory mp_rank_01 "),
    ("GPT", _partial_pp2, (), r"lacks the shard directory mp_rank_00_001 \(a TP 1 x PP 2"),
    ("GPT", _vpp_unrecorded, (), r"holds 2 model chunk\(s\), but its args record "
                                 r"virtual_pipeline_model_parallel_size 1"),
    ("BERT", lambda root: root / "src", (), r"--model-type BERT, but .* it is a GPT checkpoint"),
], ids=["tp2_without_rank_1_to_tp1", "tp2_without_rank_1_to_tp2", "pp2_without_stage_1",
        "virtual_stages_unrecorded", "bert_on_gpt"])
def test_a_partial_or_mismatched_source_is_refused_before_anything_is_written(tmp_path, capsys,
                                                                             case):
    """Regression: these converted with exit 0 -- a TP=1 output holding shard 0 only
    (attention weights half size, half the embedding rows zero), a BERT "conversion" of GPT."""
    model_type, source, layout, message = case
    model = helpers.gpt()
    helpers.save_single(tmp_path / "src", model, helpers.args_of(model))
    src = source(tmp_path)
    code = convert.main(["--model-type", model_type, "--load-dir", str(src), "--save-dir",
                         str(tmp_path / "out"), *layout])
    assert code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_gpt_model_type_on_a_bert_checkpoint_is_refused(tmp_path):
    model = helpers.bert()
    helpers.save_single(tmp_path / "src", model, helpers.args_of(model, bert_binary_head=True))
    with pytest.raises(CheckpointError, match=r"--model-type GPT, but .* holds BERT's "
                                              r".*use --model-type BERT"):
        loader_megatron.load(tmp_path / "src", "GPT")


def test_pickled_callable_is_refused_naming_the_file(tmp_path):
    model = helpers.gpt()
    sd = {"args": helpers.args_of(model), "iteration": 7, "checkpoint_version": 3.0,
          "model": model.state_dict_for_save_checkpoint(), "hook": os.system}
    path = checkpoint_name(tmp_path / "src", 7)
    path.parent.mkdir(parents=True)
    torch.save(sd, path)
    tracker_path(tmp_path / "src").write_text("7")
    _refused(tmp_path / "src", f"refusing to load {path}.*system")


def test_cli_converts_through_the_script(tmp_path):
    model = helpers.gpt(num_layers=2)
    helpers.save_single(tmp_path / "src", model, helpers.args_of(model))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "checkpoint" / "convert.py"), "--model-type", "GPT",
         "--loader", "megatron", "--saver", "megatron", "--load-dir", str(tmp_path / "src"),
         "--save-dir", str(tmp_path / "dst"), "--target-tensor-parallel-size", "2",
         "--target-pipeline-parallel-size", "2", "--megatron-path", "/nowhere"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert tracker_path(tmp_path / "dst").read_text() == "7"
    again = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "checkpoint" / "convert.py"), "--model-type", "GPT",
         "--load-dir", str(tmp_path / "src"), "--save-dir", str(tmp_path / "dst")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert again.returncode == 2 and "already holds a checkpoint" in again.stderr


def _run_config(padded: int, divisor: int, tp: int) -> types.SimpleNamespace:
    """What check_compatible reads of a run with GPT-2's 50257 tokens (a NullTokenizer)."""
    from megatron.tokenizer.config import TokenizerConfig

    ours = argparse.Namespace(padded_vocab_size=padded, make_vocab_size_divisible_by=divisor,
                              tensor_model_parallel_size=tp)
    return types.SimpleNamespace(to_namespace=lambda: ours, tokenizer=TokenizerConfig(
        tokenizer_type="NullTokenizer", vocab_size=50256))


def test_padded_vocabulary_mismatch_names_both_sizes_and_the_flag(tmp_path):
    from megatron.checkpointing.compat import check_compatible

    saved = argparse.Namespace(padded_vocab_size=50304, make_vocab_size_divisible_by=128,
                               tensor_model_parallel_size=1)
    with pytest.raises(CheckpointError) as err:
        check_compatible(saved, _run_config(50432, 128, 2), tmp_path / "model_optim_rng.pt")
    text = str(err.value)
    assert "50304 rows" in text and "to 50432" in text
    assert "pass --make-vocab-size-divisible-by 64" in text


def test_padded_vocabulary_hint_gives_a_divisor_that_loads(tmp_path):
    """TP2 -> HF (padding kept) -> TP1: 50432 rows recorded with divisor 128 at TP 1, which pads
    GPT-2 to 50304. The hint names a divisor that pads to 50432 at TP 1, and with it the
    checkpoint loads (its recorded divisor differs: only the rows must agree)."""
    from megatron.tokenizer import vocab_size_with_padding
    from megatron.checkpointing.compat import check_compatible

    saved = argparse.Namespace(padded_vocab_size=50432, make_vocab_size_divisible_by=128,
                               tensor_model_parallel_size=1)
    with pytest.raises(CheckpointError) as err:
        check_compatible(saved, _run_config(50304, 128, 1), tmp_path / "model_optim_rng.pt")
    assert "pass --make-vocab-size-divisible-by 256" in str(err.value)
    assert vocab_size_with_padding(50257, 256, 1) == 50432
    check_compatible(saved, _run_config(50432, 256, 1), tmp_path / "model_optim_rng.pt")


def test_training_loader_ignores_a_head_copy_on_a_single_stage():
    model = helpers.gpt(num_layers=2)
    state = model.state_dict_for_save_checkpoint()
    state["word_embeddings"] = {"weight": torch.zeros(264, helpers.HIDDEN)}
    other = helpers.gpt(num_layers=2, seed=8)
    other.load_state_dict(state)  # strict: the copy is not an unexpected key
    helpers.assert_same_tensors(model.state_dict(), other.state_dict())


def _bert_tp_logits(rank: int, world_size: int, iteration_dir: str):
    from megatron.checkpointing import load_checkpoint_file
    from megatron.core import parallel_state as ps
    from megatron.core.models.bert import BertModel

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        model = BertModel(helpers.config(num_tokentypes=2), ps.get_tensor_model_parallel_group(),
                          parallel_output=False).eval()
        sd = load_checkpoint_file(Path(iteration_dir) / f"mp_rank_{rank:02d}" /
                                  "model_optim_rng.pt")
        model.load_state_dict(sd["model"])
        tokens, types_ = _bert_batch()
        with torch.no_grad():
            return [t.clone() for t in model(tokens, torch.ones_like(tokens), types_)]
    finally:
        ps.destroy_model_parallel()


def _bert_batch():
    generator = torch.Generator().manual_seed(5)
    return (torch.randint(0, 255, (2, 12), generator=generator),
            torch.randint(0, 2, (2, 12), generator=generator))


def test_bert_converted_to_tp2_gives_the_source_logits(tmp_path):
    from tests.multiprocess import run_distributed

    model = helpers.bert()
    helpers.save_single(tmp_path / "src", model, helpers.args_of(model, bert_binary_head=True))
    out = _convert(tmp_path / "src", tmp_path / "tp2", *_layout(2, 1), model_type="BERT")
    tokens, types_ = _bert_batch()
    with torch.no_grad():
        expected = model(tokens, torch.ones_like(tokens), types_)
    for lm, binary in run_distributed(2, _bert_tp_logits, str(out / "iter_0000007")):
        assert (lm - expected[0]).abs().max() <= 1e-5
        assert (binary - expected[1]).abs().max() <= 1e-5


def test_use_checkpoint_args_takes_the_checkpoints_padded_vocabulary(tmp_path, shared_data,
                                                                     megatron_log):
    """A checkpoint whose padding is not --make-vocab-size-divisible-by x TP of its own args (as
    Megatron-LM's converter leaves one re-split to TP2: 128 x 1 padding, TP 2 in the args)."""
    from megatron.config.validate import validate
    from megatron.config.cli import build_parser, parse_flags
    from megatron.training.initialize import apply_checkpoint_args, build_tokenizer_from_config

    vocab = shared_data / "tokenizers" / "gpt2-vocab.json"
    merges = shared_data / "tokenizers" / "gpt2-merges.txt"
    model = helpers.gpt(num_layers=2, vocab=50304)
    args = helpers.args_of(model, tensor_model_parallel_size=2, make_vocab_size_divisible_by=128,
                           tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab),
                           merge_file=str(merges), seq_length=helpers.MAX_POSITIONS)
    helpers.save_single(tmp_path / "src", model, args)
    flags = parse_flags(build_parser(), [
        "--use-checkpoint-args", "--load", str(tmp_path / "src"), "--ckpt-step", "7",
        "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4"])
    apply_checkpoint_args(flags)
    cfg = validate(flags, world_size=2)
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.padded_vocab_size == 50304  # not 50432 = 50257 padded to 128 x 2
    assert build_tokenizer_from_config(cfg).padded_vocab_size == 50304
    logged = [r.getMessage() for r in megatron_log if "padded vocab" in r.getMessage()]
    assert len(logged) == 1 and "(new size: 50304, the checkpoint's" in logged[0], logged
