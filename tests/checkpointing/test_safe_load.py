"""megatron.checkpointing.safe_load: Megatron-LM core_v0.13's ``rerun_state_machine`` entry is
read as data, and written back under Megatron's own names."""

from __future__ import annotations

import io
import pickletools
import zipfile

import pytest

from megatron.checkpointing import load_checkpoint_file, save_file


def _globals(path) -> list[str]:
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    return [arg for op, arg, _ in pickletools.genops(io.BytesIO(data)) if op.name == "GLOBAL"]


def test_megatron_v013_rerun_state_is_read_as_data_and_written_back_as_megatron_names(
        shared_data, tmp_path):
    source = shared_data / "megatron_llama_v013" / "megatron_tp1" / "iter_0000001" / \
        "mp_rank_00" / "model_optim_rng.pt"
    if not source.is_file():
        pytest.skip(f"{source} is absent")
    sd = load_checkpoint_file(source)
    rerun = sd["rerun_state_machine"]
    assert rerun["mode"].value == "disabled"
    assert rerun["sharded"]["state"].name == "NOT_RUNNING_YET"
    assert rerun["sharded"]["error_injector_checkpoint"]["error_injection_type"].value == \
        "transient_error"
    copy = tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    save_file(sd, copy)
    megatron = [g for g in _globals(source) if g.startswith("megatron.")]
    assert megatron and sorted(megatron) == sorted(g for g in _globals(copy)
                                                   if g.startswith("megatron."))
    again = load_checkpoint_file(copy)
    assert again["rerun_state_machine"]["mode"] == rerun["mode"]
    assert again["args"].attention_backend == sd["args"].attention_backend
