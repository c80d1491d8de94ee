"""Reading and writing a ``torch_dist`` directory with ``torch.distributed.checkpoint`` (DCP),
as Megatron-Core's ``dist_checkpointing`` lays it out::

    DIR/.metadata          DCP's index: every key's global shape and chunks, pickled
    DIR/__<rank>_0.distcp  the chunks rank <rank> wrote
    DIR/metadata.json      {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    DIR/checksums.sha256   the sha256 of every file above (ours; Megatron-Core ignores it)

Tensors are ``ShardedTensor``s whose local shards are this rank's :class:`~.keys.Chunk` views
(so a load writes straight into them); objects (``common_state``, ``rng_state``,
``_extra_state``) are ``ShardedObject`` shards, stored as the bytes of ``torch.save([obj])``
under ``<key>/shard_<offset>_<shape>``. Replicated chunks are written once: DCP's global plan
keeps one copy, on the least loaded rank (``--ckpt-fully-parallel-save``) or the lowest rank.

Nothing runs code on load: ``.metadata`` is unpickled with an allowlist of DCP's own metadata
classes, and every object with ``torch.load(weights_only=True)`` plus the checkpoint allowlist of
``megatron.checkpointing.safe_load``. Files are checked against ``checksums.sha256`` (or, for a
directory Megatron-Core wrote, against the sizes ``.metadata`` expects) before anything is read,
and errors name the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import pickle
from enum import Enum
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from megatron.core import comm
from megatron.checkpointing.dist.detect import BACKEND_FILE, is_torch_dist_dir  # noqa: F401
from megatron.checkpointing.dist.keys import Chunk
from megatron.checkpointing.errors import CheckpointError, corrupt_file_error
from megatron.checkpointing.files import write_manifest
from megatron.checkpointing.names import MANIFEST_FILENAME
from megatron.checkpointing.safe_load import safe_globals

METADATA_FILE = ".metadata"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
COMMON_STATE = "common_state"
LEGACY_COMMON_FILE = "common.pt"
STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
              "raise_all", "return_unexpected", "return_all", "ignore_all")
"""Megatron-Core's ``StrictHandling`` values. Its words: an *unexpected* key is asked for but
not in the checkpoint; a *missing* key is in the checkpoint but not asked for."""


def object_key(key: str, offset: Iterable[int] = (0,), shape: Iterable[int] = (1,)) -> str:
    """A ``ShardedObject`` shard's key: ``<key>/shard_<offset>_<shape>`` (dot-joined)."""
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"


COMMON_STATE_KEY = object_key(COMMON_STATE)


# ShardedTensors -------------------------------------------------------------------------------
def sharded_tensor(chunks: list[Chunk]) -> ShardedTensor:
    """This rank's ``chunks`` of one key as a ``ShardedTensor``. DCP needs the global metadata
    to cover the tensor, so the grid positions other ranks hold get placeholders (only this
    rank's shards are used; Megatron-Core does the same)."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    global_shape = chunks[0].global_shape
    size = tuple(chunks[0].data.shape)
    if any(tuple(c.data.shape) != size for c in chunks):
        raise AssertionError(f"uneven chunks of one key: {[tuple(c.data.shape) for c in chunks]}")
    device = chunks[0].data.device.type
    local = [Shard.from_tensor_and_offsets(c.data, list(c.offset), rank) for c in chunks]
    mine = {tuple(c.offset) for c in chunks}
    metadata = [s.metadata for s in local]
    grid = [range(0, g, s) for g, s in zip(global_shape, size)]
    for offset in itertools.product(*grid):
        if offset not in mine:
            if world == 1:
                raise AssertionError(f"a single rank lacks the chunk at {offset}")
            metadata.append(ShardMetadata(list(offset), list(size),
                                          f"rank:{(rank + 1) % world}/{device}"))
    tensor_md = ShardedTensorMetadata(
        shards_metadata=metadata, size=torch.Size(global_shape),
        tensor_properties=TensorProperties(dtype=chunks[0].data.dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, sharded_tensor_metadata=tensor_md, process_group=None)


def _pack(obj: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save([obj], buffer)
    buffer.seek(0)
    return buffer


def unpack(buffer: io.BytesIO | bytes, what: str) -> Any:
    """An object's bytes -> the object, running no code (``[obj]`` as Megatron-Core saves it).

    Raises:
        CheckpointError: unreadable, or holding a type outside the allowlist.
    """
    if isinstance(buffer, bytes):
        buffer = io.BytesIO(buffer)
    buffer.seek(0)
    try:
        with torch.serialization.safe_globals(safe_globals()):
            value = torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - every failure means "refused"
        raise CheckpointError(f"refusing to load {what}: {str(err).splitlines()[0][:300]} "
                              "(corrupt, or holding a type outside the allowlist of checkpoint "
                              "types, which could run code)") from None
    if isinstance(value, list) and len(value) == 1:
        return value[0]
    return value


# Save -----------------------------------------------------------------------------------------
class _SavePlanner(DefaultSavePlanner):
    """DCP's planner with objects already serialized (they are ``torch.save([obj])`` bytes)."""

    def transform_object(self, write_item, object):  # noqa: A002 - DCP's signature
        return object


def stage(tensors: Mapping[str, list[Chunk]], objects: Mapping[str, Any],
          to_host: bool = False) -> dict[str, Any]:
    """The DCP state dict of this rank's chunks and objects (objects serialized now).

    ``to_host``: chunks copied to host memory (an asynchronous save writes them while training
    changes the originals)."""
    if to_host:
        tensors = {key: [Chunk(c.data.detach().to("cpu", copy=True), c.offset, c.global_shape)
                         for c in chunks] for key, chunks in tensors.items()}
    state: dict[str, Any] = {key: sharded_tensor(chunks) for key, chunks in tensors.items()}
    state.update({key: _pack(obj) for key, obj in objects.items()})
    return state


def write(directory: Path, state: dict[str, Any], fully_parallel: bool = True,
          ckpt_group=None) -> dict[str, str]:
    """Write a state dict made by :func:`stage` (collective over ``ckpt_group``, default the world).

    Returns:
        ``{file name: sha256}`` of the files this rank wrote.
    """
    directory.mkdir(parents=True, exist_ok=True)
    writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=True, sync_files=True,
                                  thread_count=1, overwrite=True)
    planner = _SavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False,
                           dedup_save_to_lowest_rank=not fully_parallel)
    dcp.save(state, storage_writer=writer, planner=planner, process_group=ckpt_group)
    mine = directory / f"__{dist.get_rank()}_0.distcp"
    return {mine.name: _sha256(mine)} if mine.is_file() else {}


def save(directory: Path, tensors: Mapping[str, list[Chunk]], objects: Mapping[str, Any],
         fully_parallel: bool = True) -> dict[str, str]:
    """Write every rank's chunks and objects to ``directory`` (collective over the world).

    Args:
        tensors: this rank's ``{key: chunks}``; replicas on several ranks are written once.
        objects: ``{shard key: object}`` (:func:`object_key`); the same key on several ranks
            must hold the same object.
        fully_parallel: spread replicated chunks over the ranks holding them (else the lowest
            rank writes each).

    Returns:
        ``{file name: sha256}`` of the files this rank wrote.
    """
    return write(directory, stage(tensors, objects), fully_parallel)


def finish(directory: Path, digests: Mapping[str, str]) -> None:
    """On one rank, after every rank's :func:`save`: ``metadata.json`` and the checksums."""
    (directory / BACKEND_FILE).write_text(json.dumps(BACKEND))
    every = dict(digests)
    for name in (METADATA_FILE, BACKEND_FILE):
        every[name] = _sha256(directory / name)
    write_manifest(directory, every)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


# Metadata -------------------------------------------------------------------------------------
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata``: its own dataclasses and enums, torch sizes and dtypes only."""

    def find_class(self, module: str, name: str):
        if module in _DCP_MODULES:
            found = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(found, type) and (dataclasses.is_dataclass(found)
                                            or issubclass(found, Enum)):
                return found
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return torch.serialization._get_layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath",
                                            "PureWindowsPath", "Path"):
            import pathlib
            return pathlib.PurePosixPath  # the path the writer recorded: inert text here
        if (module, name) == ("collections", "OrderedDict"):
            import collections
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint metadata type")


def read_metadata(directory: Path) -> Metadata:
    """``.metadata``, unpickled without running code.

    Raises:
        CheckpointError: missing, truncated, or holding other types.
    """
    path = directory / METADATA_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a torch_dist checkpoint: it has no "
                              f"{METADATA_FILE}")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as err:  # noqa: BLE001 - any failure: refused
        raise corrupt_file_error(path, f"{type(err).__name__}: {err}") from None
    if not isinstance(metadata, Metadata):
        raise corrupt_file_error(path, f"it holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata read by :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        metadata.storage_meta = metadata.storage_meta or \
            torch.distributed.checkpoint.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_files(directory: Path, metadata: Metadata, verify_checksums: bool = True) -> None:
    """Every file ``.metadata`` points into exists and is long enough; with a
    ``checksums.sha256`` (ours), every file matches it.

    Raises:
        CheckpointError: naming the file.
    """
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing (.metadata lists chunks "
                                  "in it): an incomplete copy or save")
        if path.stat().st_size < size:
            raise corrupt_file_error(path, f"it has {path.stat().st_size} bytes, and "
                                           f".metadata expects at least {size} (truncated)")
    manifest = directory / MANIFEST_FILENAME
    if not verify_checksums or not manifest.is_file():
        return
    # Every rank hashes its share of the files; a failure is raised on every rank (none may
    # go on into DCP's collectives alone).
    share = (dist.get_rank(), dist.get_world_size()) \
        if dist.is_initialized() and dist.get_world_size() > 1 else (0, 1)
    problem = None
    lines = manifest.read_text().splitlines()
    for index, line in enumerate(lines):
        if index % share[1] != share[0] or problem is not None:
            continue
        digest, _, name = line.partition("  ")
        path = directory / name
        if name == BACKEND_FILE or not path.is_file() and name not in needed:
            continue
        if not path.is_file():
            problem = f"checkpoint file {path} is missing"
        elif _sha256(path) != digest:
            problem = (f"corrupt or truncated checkpoint file {path}: its sha256 differs from "
                       f"the one {manifest} recorded when it was saved. Restore it from a good "
                       "copy, or pass --no-verify-checkpoint-checksums to load it anyway")
    if share[1] > 1:
        every = comm.all_gather_object(problem, comm.world_group())
        problem = next((p for p in every if p is not None), None)
    if problem is not None:
        raise CheckpointError(problem)


# Load -----------------------------------------------------------------------------------------
class _LoadPlanner(DefaultLoadPlanner):
    """DCP's load planner whose objects are read by :func:`unpack` (no code runs)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.directory = directory

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        self.state_dict[fqn] = unpack(value, f"{fqn} of {self.directory}")


@dataclasses.dataclass
class Mismatch:
    """Keys asked for but not in the checkpoint (``unexpected``) and the reverse
    (``missing``), in Megatron-Core's words."""

    unexpected: list[str]
    missing: list[str]


def compare(metadata: Metadata, tensors: Mapping[str, list[Chunk]],
            objects: Iterable[str], directory: Path) -> Mismatch:
    """Keys and global shapes asked for vs the checkpoint's.

    Raises:
        CheckpointError: a key whose global shape differs.
    """
    stored = metadata.state_dict_metadata
    problems = []
    for key, chunks in tensors.items():
        md = stored.get(key)
        if md is None:
            continue
        if isinstance(md, BytesStorageMetadata):
            problems.append(f"{key}: an object in the checkpoint, a tensor in this model")
        elif tuple(md.size) != tuple(chunks[0].global_shape):
            problems.append(f"{key}: checkpoint {tuple(md.size)}, model "
                            f"{tuple(chunks[0].global_shape)}")
    if problems:
        raise CheckpointError(f"the torch_dist checkpoint {directory} does not fit this model "
                              "(global shapes differ):\n  " + "\n  ".join(problems))
    asked = set(tensors) | set(objects)
    if dist.is_initialized() and dist.get_world_size() > 1:
        # A key is "missing" only when no rank asks for it (each holds part of the model).
        every = comm.all_gather_object(sorted(asked), comm.world_group())
        everyone = set().union(*map(set, every))
    else:
        everyone = asked
    return Mismatch(unexpected=sorted(k for k in asked if k not in stored),
                    missing=sorted(k for k in stored if k not in everyone
                                   and k != COMMON_STATE_KEY))


def load(directory: Path, tensors: Mapping[str, list[Chunk]], objects: Iterable[str],
         metadata: Metadata | None = None) -> dict[str, Any]:
    """Read this rank's ``tensors`` chunks in place (every rank its own: collective) and the
    ``objects``; every key must be in the checkpoint (filter with :func:`compare` first).

    Returns:
        ``{object key: object}``.

    Raises:
        CheckpointError: a file could not be read, naming it.
    """
    state: dict[str, Any] = {key: sharded_tensor(chunks) for key, chunks in tensors.items()}
    objects = list(objects)
    state.update({key: io.BytesIO() for key in objects})
    reader = _SafeReader(str(directory))
    planner = _LoadPlanner(directory)
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - DCP wraps every rank's failure
        raise CheckpointError(f"reading the torch_dist checkpoint {directory} failed: "
                              f"{_first_error(err)}") from None
    return {key: planner.state_dict[key] for key in objects}


def _first_error(err: BaseException) -> str:
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))
        if isinstance(err, tuple):  # (exception, traceback) in some torch versions
            err = err[0]
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:400] if lines else ''}"


def read_common_state(directory: Path) -> dict:
    """The checkpoint's common (non-sharded) state: the ``common_state`` object (Megatron-Core
    0.19) or a ``common.pt`` (0.13). Readable from one process, without a process group.

    Raises:
        CheckpointError: neither, or unreadable.
    """
    legacy = directory / LEGACY_COMMON_FILE
    if legacy.is_file():
        from megatron.checkpointing.safe_load import load_checkpoint_file
        return load_checkpoint_file(legacy)
    metadata = read_metadata(directory)
    if COMMON_STATE_KEY not in metadata.state_dict_metadata:
        raise CheckpointError(f"the torch_dist checkpoint {directory} has neither a "
                              f"{COMMON_STATE} object nor a {LEGACY_COMMON_FILE}")
    check_files(directory, metadata, verify_checksums=False)
    return read_objects(directory, metadata, [COMMON_STATE_KEY])[COMMON_STATE_KEY] or {}


def read_objects(directory: Path, metadata: Metadata, keys: Iterable[str]) -> dict[str, Any]:
    """Objects read directly from their files (one process, no DCP plan)."""
    out = {}
    for key in keys:
        info = next((v for k, v in metadata.storage_data.items() if k.fqn == key), None)
        if info is None:
            raise CheckpointError(f"the torch_dist checkpoint {directory} has no {key}")
        path = directory / info.relative_path
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise corrupt_file_error(path, f"{key} ends past the end of the file")
        out[key] = unpack(data, f"{key} in {path}")
    return out


def read_plain_tensors(directory: Path, keys: Iterable[str] | None = None
                       ) -> dict[str, torch.Tensor]:
    """Whole global tensors (all of them, or ``keys``) from one process: for tools and tests.

    Raises:
        CheckpointError: an unreadable file, naming it.
    """
    metadata = read_metadata(directory)
    check_files(directory, metadata)
    stored = metadata.state_dict_metadata
    wanted = [k for k, md in stored.items() if not isinstance(md, BytesStorageMetadata)] \
        if keys is None else list(keys)
    # cpu-by-design: whole tensors read for a tool, on the host.
    state = {k: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype,
                            device="cpu")
             for k in wanted}
    try:
        dcp.load(state, storage_reader=_SafeReader(str(directory)),
                 planner=_LoadPlanner(directory), no_dist=True)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"reading the torch_dist checkpoint {directory} failed: "
                              f"{_first_error(err)}") from None
    return state
