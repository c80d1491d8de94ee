"""Checkpoints written by Megatron-LM load through ``pretrain(--load)``.

A checkpoint of this framework (fp16, iteration 3 of 6) is rewritten the way Megatron-LM 23.06
writes it, then loaded, and training must go on with the losses of the uninterrupted run:

* ``args``: a Megatron-style ``argparse.Namespace`` holding ``model_type =
  megatron.core.enums.ModelType.encoder_or_decoder`` (and ``params_dtype = torch.float16``);
* ``optimizer``: the fp16 wrapper layout with apex ``FusedAdam`` state (``step`` in the param
  groups, not per parameter; no torch-only group options such as ``decoupled_weight_decay``);
* ``rng_state``: CUDA-sized generator states, as a GPU run leaves them (skipped with a warning
  on the CPU; dropout then draws from the seeded streams);
* ``model``: the nested ``language_model.embedding / encoder`` dicts (docs/FORMATS.md 2d).

QKV row order by ``checkpoint_version`` (docs/FORMATS.md 2d): the same checkpoint with its QKV rows
permuted into the version-0 ``[3, np, hn]`` (and no version key, as the oldest ones) and the
version-1.0 ``[np, hn, 3]`` orders loads to the same losses (TP=1 and, per TP shard, TP=2); an
unknown version is refused.

Unit checks (no processes): newer Megatron enums (``AttnBackend``, ``AttnMaskType``, values this
code does not know) load as inert stand-ins without importing anything, while any other class
from a Megatron module is still refused.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron.checkpointing import manifest_path
from megatron.training.checkpointing import (MODEL_FILENAME, TRACKER_FILENAME, CheckpointError,
                                             MegatronEnum, load_checkpoint_file)
from tests.training import e2e

FP16 = {"iters": 6, "seq": 16, "mbs": 1, "gbs": 2, "lr": 3e-3}
FP16_FLAGS = ["--fp16", "--initial-loss-scale", "1024"]
TP2 = {"tp": 2, "iters": 6, "seq": 16, "mbs": 1, "gbs": 2, "lr": 3e-3}
SAVED_AT = 3
HEADS = 4  # e2e.TINY_MODEL
RESUME_TOL = 1e-6

# Megatron-LM's enums as its modules define them (megatron/core/enums.py,
# megatron/core/transformer/enums.py).
MEGATRON_ENUMS = {
    "megatron.core.enums": {"ModelType": ["encoder_or_decoder", "encoder_and_decoder",
                                          "retro_encoder", "retro_decoder"]},
    "megatron.core.transformer.enums": {
        "AttnMaskType": ["padding", "causal", "no_mask", "padding_causal", "arbitrary"],
        "AttnBackend": ["flash", "fused", "unfused", "local", "auto"]},
}


@contextlib.contextmanager
def megatron_modules():
    """Importable stand-ins for Megatron-LM's enum modules, so pickle writes Megatron's names."""
    added = {}
    for module_name, classes in MEGATRON_ENUMS.items():
        module = types.ModuleType(module_name)
        for name, members in classes.items():
            setattr(module, name, enum.Enum(name, members, module=module_name, qualname=name))
        added[module_name] = module
    assert not set(added) & set(sys.modules)
    sys.modules.update(added)
    try:
        yield added
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _shard(root: Path, iteration: int = SAVED_AT, tp_rank: int = 0) -> Path:
    return root / f"iter_{iteration:07d}" / f"mp_rank_{tp_rank:02d}" / MODEL_FILENAME


def _rewrite(src: Path, dst: Path, tp: int, change) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with ``change(state_dict, tp_rank)`` applied to every
    shard, written as Megatron-LM writes it: without the iteration's checksum manifest."""
    shutil.copytree(src, dst)
    for tp_rank in range(tp):
        sd = torch.load(_shard(src, tp_rank=tp_rank), map_location="cpu", weights_only=False)
        change(sd, tp_rank)
        torch.save(sd, _shard(dst, tp_rank=tp_rank))
    manifest_path(_shard(dst, tp_rank=0)).unlink()
    return dst


# ---------------------------------------------------------------------------------------------
# Megatron-LM 23.06 layout
# ---------------------------------------------------------------------------------------------

def _fused_adam_state(torch_state: dict) -> dict:
    """torch AdamW's state dict as apex FusedAdam's: ``step`` per group, not per parameter."""
    (step,) = {int(s["step"]) for s in torch_state["state"].values()}
    groups = [{"params": g["params"], "lr": g["lr"], "bias_correction": True,
               "betas": tuple(g["betas"]), "eps": g["eps"], "weight_decay": g["weight_decay"],
               "wd_mult": g["wd_mult"], "lr_mult": g["lr_mult"], "step": step}
              for g in torch_state["param_groups"]]
    state = {index: {"exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]}
             for index, s in torch_state["state"].items()}
    return {"state": state, "param_groups": groups}


def _as_megatron_2306(sd: dict, tp_rank: int) -> None:
    ours = sd["args"]
    model_type = sys.modules["megatron.core.enums"].ModelType
    sd["args"] = argparse.Namespace(
        num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=HEADS,
        kv_channels=16, max_position_embeddings=FP16["seq"], seq_length=FP16["seq"],
        padded_vocab_size=50304, make_vocab_size_divisible_by=128,
        tokenizer_type="GPT2BPETokenizer", tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, data_parallel_size=1, world_size=1,
        micro_batch_size=FP16["mbs"], global_batch_size=FP16["gbs"], fp16=True, bf16=False,
        params_dtype=torch.float16, model_type=model_type.encoder_or_decoder,
        use_distributed_optimizer=False, add_position_embedding=True, add_bias_linear=True,
        untie_embeddings_and_output_weights=False, position_embedding_type="learned_absolute",
        transformer_impl="local", optimizer="adam", iteration=SAVED_AT,
        consumed_train_samples=ours.consumed_train_samples,
        consumed_valid_samples=ours.consumed_valid_samples)
    wrapper = sd["optimizer"]
    assert set(wrapper) == {"optimizer", "grad_scaler", "fp32_from_fp16_params"}, set(wrapper)
    sd["optimizer"] = {**wrapper, "optimizer": _fused_adam_state(wrapper["optimizer"])}
    # A GPU run's generator states (CUDA philox: 16 bytes) cannot seed the CPU generator.
    (rng,) = sd["rng_state"]
    sd["rng_state"] = [{**rng, "cuda_rng_state": torch.zeros(16, dtype=torch.uint8),
                        "rng_tracker_states": {"model-parallel-rng":
                                               torch.zeros(16, dtype=torch.uint8)}}]
    sd.pop("num_floating_point_operations_so_far", None)  # v0.13 only


# ---------------------------------------------------------------------------------------------
# QKV row orders of checkpoint versions 0 and 1.0
# ---------------------------------------------------------------------------------------------

def _qkv_to_old_order(version: float | None, heads: int):
    """Rows [np, 3, hn] (version >= 2.0) -> [3, np, hn] (0) or [np, hn, 3] (1.0)."""

    def change(sd: dict, tp_rank: int) -> None:
        encoder = sd["model"]["language_model"]["encoder"]
        for key in [k for k in encoder if ".query_key_value." in k]:
            t = encoder[key]
            per_head = t.view(heads, 3, t.shape[0] // (3 * heads), *t.shape[1:])
            old = per_head.transpose(0, 1) if version is None or version == 0 else \
                per_head.transpose(1, 2)
            encoder[key] = old.contiguous().view(t.shape)
            assert not torch.equal(encoder[key], t)
        if version is None:
            del sd["checkpoint_version"]
        else:
            sd["checkpoint_version"] = version

    return change


# ---------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(gpt2_corpus, tmp_path_factory):
    base = tmp_path_factory.mktemp("compat")
    c = gpt2_corpus
    fp16_saved, tp2_saved = base / "fp16", base / "tp2"
    first = e2e.pooled(1, [
        {"argv": e2e.gpt_argv(c, **FP16, extra=FP16_FLAGS)},
        {"argv": e2e.gpt_argv(c, **FP16, extra=[*FP16_FLAGS, "--save", fp16_saved,
                                                "--save-interval", "1000",
                                                "--exit-interval", SAVED_AT])}])
    first_tp2 = e2e.pooled(2, [
        {"argv": e2e.gpt_argv(c, **TP2)},
        {"argv": e2e.gpt_argv(c, **TP2, extra=["--save", tp2_saved, "--save-interval", "1000",
                                               "--exit-interval", SAVED_AT])}])
    with megatron_modules():
        megatron = _rewrite(fp16_saved, base / "megatron_2306", 1, _as_megatron_2306)
    v0 = _rewrite(fp16_saved, base / "v0", 1, _qkv_to_old_order(None, HEADS))
    v1 = _rewrite(fp16_saved, base / "v1", 1, _qkv_to_old_order(1.0, HEADS))
    unknown = _rewrite(fp16_saved, base / "v1_5", 1, _qkv_to_old_order(1.5, HEADS))
    tp2_v0 = _rewrite(tp2_saved, base / "tp2_v0", 2, _qkv_to_old_order(0.0, HEADS // 2))
    names = ["megatron_2306", "v0", "v1", "v1_5", "megatron_2306_dropout"]
    loads = e2e.pooled(1, [{"argv": e2e.gpt_argv(c, **FP16, extra=[*FP16_FLAGS, "--load", root])}
                           for root in (megatron, v0, v1, unknown)]
                       # Dropout forks the model-parallel RNG stream, whose saved state is CUDA's.
                       + [{"argv": e2e.gpt_argv(c, **FP16, dropout=0.1, extra=[
                           *FP16_FLAGS, "--load", megatron])}],
                       expect_error=(CheckpointError,))
    tp2_load = e2e.pooled(2, [{"argv": e2e.gpt_argv(c, **TP2, extra=["--load", tp2_v0])}],
                          expect_error=(CheckpointError,))[0]
    out = {name: result[0] for name, result in zip(names, loads)}
    out.update(straight=first[0][0], saved=first[1][0], tp2_straight=first_tp2[0],
               tp2_v0=tp2_load, megatron_root=megatron)
    return out


def _assert_continues(straight: dict, resumed: dict, what: str) -> None:
    assert resumed["error"] is None, f"{what}: {resumed['error']}"
    assert resumed["iteration"] == FP16["iters"]
    expected = e2e.losses(straight)[SAVED_AT:]
    diff = e2e.max_abs_diff(expected, e2e.losses(resumed))
    assert diff <= RESUME_TOL, f"{what}: {diff:.3g}\n  {expected}\n  {e2e.losses(resumed)}"


def test_megatron_2306_checkpoint_loads_and_training_continues(runs):
    assert runs["saved"]["iteration"] == SAVED_AT
    _assert_continues(runs["straight"], runs["megatron_2306"], "Megatron-LM 23.06 checkpoint")


def test_gpu_rng_tracker_states_do_not_break_dropout_on_the_cpu(runs):
    """The fixture's RNG tracker states are CUDA-sized: they are skipped (with a warning), so
    dropout runs on the CPU's freshly seeded stream instead of failing at the first fork."""
    run = runs["megatron_2306_dropout"]
    assert run["error"] is None and run["iteration"] == FP16["iters"]
    assert len(e2e.losses(run)) == FP16["iters"] - SAVED_AT


def test_megatron_2306_fixture_has_megatron_types(runs):
    """The fixture really holds what made loading fail: Megatron's enum and FusedAdam state."""
    sd = load_checkpoint_file(_shard(runs["megatron_root"]))
    assert isinstance(sd["args"].model_type, MegatronEnum)
    assert sd["args"].model_type.name == "encoder_or_decoder"
    assert "megatron.core.enums" not in sys.modules
    assert (runs["megatron_root"] / TRACKER_FILENAME).read_text().strip() == str(SAVED_AT)
    groups = sd["optimizer"]["optimizer"]["param_groups"]
    assert all("step" in g and "decoupled_weight_decay" not in g for g in groups)
    assert all("step" not in s for s in sd["optimizer"]["optimizer"]["state"].values())
    raw = _shard(runs["megatron_root"]).read_bytes()
    assert b"megatron.core.enums" in raw and b"ModelType" in raw


@pytest.mark.parametrize("version", ["v0", "v1"])
def test_old_qkv_order_is_converted(runs, version):
    _assert_continues(runs["straight"], runs[version], f"checkpoint {version}")


def test_old_qkv_order_is_converted_per_tensor_parallel_shard(runs):
    for rank in range(2):
        straight, resumed = runs["tp2_straight"][rank], runs["tp2_v0"][rank]
        _assert_continues(straight, resumed, f"TP=2 version 0, rank {rank}")


def test_unknown_checkpoint_version_is_refused(runs):
    error = runs["v1_5"]["error"]
    assert error is not None and error.startswith("CheckpointError")
    assert "checkpoint_version 1.5" in error and MODEL_FILENAME in error


# ---------------------------------------------------------------------------------------------
# Unit checks of the allowlist
# ---------------------------------------------------------------------------------------------

def test_newer_megatron_enums_load_as_inert_stand_ins(tmp_path):
    path = tmp_path / "args.pt"
    with megatron_modules() as modules:
        te = modules["megatron.core.transformer.enums"]
        unknown = enum.Enum("ModelType", {"some_future_type": 9}, module="megatron.core.enums",
                            qualname="ModelType")
        modules["megatron.core.enums"].ModelType = unknown
        args = argparse.Namespace(attention_backend=te.AttnBackend.auto,
                                  attn_mask_type=te.AttnMaskType.causal,
                                  model_type=unknown.some_future_type)
        torch.save({"args": args, "iteration": 1}, path)
    loaded = load_checkpoint_file(path)["args"]
    assert (loaded.attention_backend.name, loaded.attention_backend.value) == ("auto", 5)
    assert (loaded.attn_mask_type.name, loaded.attn_mask_type.value) == ("causal", 2)
    assert loaded.model_type.value == 9  # a value this code does not know
    assert not {"megatron.core.enums", "megatron.core.transformer.enums"} & set(sys.modules)


def test_other_classes_under_megatron_names_are_still_refused(tmp_path):
    path = tmp_path / "evil.pt"
    module = types.ModuleType("megatron.core.enums")
    evil = type("Evil", (), {"__module__": "megatron.core.enums",
                             "__init__": lambda self, value: setattr(self, "value", value)})
    module.Evil = evil
    sys.modules["megatron.core.enums"] = module
    try:
        torch.save({"args": argparse.Namespace(x=evil(1))}, path)
    finally:
        sys.modules.pop("megatron.core.enums")
    with pytest.raises(CheckpointError, match=r"holds megatron\.core\.enums\.Evil"):
        load_checkpoint_file(path)
