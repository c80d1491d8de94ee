"""A torch_dist directory that is truncated, corrupt, incomplete or that would run code on load
is refused with the file named (no process group needed: copies of Megatron-Core's fixtures);
the strictness modes of missing and unexpected keys."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megatron.checkpointing.dist import storage
from megatron.checkpointing.dist.model import check_strictness
from megatron.checkpointing.errors import CheckpointError

MCORE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "mcore"
pytestmark = pytest.mark.skipif(not MCORE.is_dir(), reason=f"{MCORE} is not here")


@pytest.fixture
def copy(tmp_path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(MCORE / "llama_rope10k" / "torch_dist_wrapped", out)
    for path in out.iterdir():
        path.chmod(0o644)
    return out


def test_an_intact_copy_loads(copy):
    tensors = storage.read_plain_tensors(copy)
    reference = torch.load(MCORE / "llama_rope10k" / "state_dict.pt", weights_only=True)
    assert torch.equal(tensors["output_layer.weight"], reference["output_layer.weight"])


def test_a_truncated_shard_is_refused_by_name(copy):
    shard = copy / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp.*truncated"):
        storage.read_plain_tensors(copy)


def test_a_missing_shard_is_refused_by_name(copy):
    (copy / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is missing"):
        storage.read_plain_tensors(copy)


def test_corrupt_metadata_is_refused_by_name(copy):
    (copy / ".metadata").write_bytes(b"\x80\x04not a pickle at all")
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        storage.read_plain_tensors(copy)


def test_a_flipped_byte_fails_the_checksum(copy):
    from megatron.checkpointing.files import write_manifest
    write_manifest(copy, {p.name: storage._sha256(p) for p in copy.iterdir()})
    storage.read_plain_tensors(copy)  # the checksums match
    shard = copy / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupt or truncated checkpoint file .*"
                                              r"__0_0\.distcp: its sha256 differs"):
        storage.read_plain_tensors(copy)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dist_ckpt_pwned",))


def test_metadata_that_would_run_code_is_refused(copy, tmp_path):
    marker = Path("/tmp/dist_ckpt_pwned")
    marker.unlink(missing_ok=True)
    (copy / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(CheckpointError, match=r"\.metadata.*not a checkpoint metadata type"):
        storage.read_metadata(copy)
    assert not marker.exists()


def test_an_object_that_would_run_code_is_refused():
    import io
    buffer = io.BytesIO()
    torch.save([_RunsCode()], buffer)
    with pytest.raises(CheckpointError, match="refusing to load common_state"):
        storage.unpack(buffer.getvalue(), "common_state")
    assert storage.unpack(storage._pack({"iteration": 7}), "x") == {"iteration": 7}


@pytest.mark.parametrize("mode,unexpected,missing,refused", [
    ("assume_ok_unexpected", ["a"], [], True),
    ("assume_ok_unexpected", [], ["b"], False),
    ("raise_unexpected", ["a"], [], True),
    ("raise_all", [], ["b"], True),
    ("raise_all", [], [], False),
    ("log_unexpected", ["a"], ["b"], False),
    ("log_all", ["a"], ["b"], False),
    ("return_all", ["a"], ["b"], False),
    ("ignore_all", ["a"], ["b"], False),
])
def test_strictness(mode, unexpected, missing, refused):
    logged = []
    mismatch = storage.Mismatch(unexpected=unexpected, missing=missing)
    if refused:
        with pytest.raises(CheckpointError):
            check_strictness(mismatch, mode, "DIR", logged.append)
        return
    check_strictness(mismatch, mode, "DIR", logged.append)
    assert bool(logged) == (mode.startswith("log_") and bool(unexpected or (
        mode == "log_all" and missing)))


def test_an_unknown_strictness_is_refused():
    with pytest.raises(ValueError, match="--dist-ckpt-strictness"):
        check_strictness(storage.Mismatch([], []), "strict", "DIR")
