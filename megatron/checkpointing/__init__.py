"""Megatron-LM's checkpoint format (``--ckpt-format torch``), apart from training: usable from a
plain script, with no process group and no ``MegatronConfig``.

* ``names``: ``iter_XXXXXXX`` / ``release`` directories, ``mp_rank_XX[_YYY]`` shards, the tracker
  file; ``keys``: which top-level entries hold a model (the model dict's own keys, its
  nesting and old names live in :mod:`megatron.core.checkpoint_keys`); ``versions``:
  ``checkpoint_version`` and the QKV row orders of old versions (plain integers in, tensors
  out);
* ``layout``: how every tensor is split over TP ranks and which pipeline stage holds it, as a
  table per model family (:data:`GPT_LAYOUT`), with merge / split over TP and PP; ``stages``:
  the layers of each pipeline stage;
* ``files``: atomic writes, the per-iteration sha256 manifest, stale temporary files, write
  errors;
  ``safe_load``: reading without running code;
* ``compat``: does a checkpoint's saved args fit the run loading it (compared flags, hints).

Training-time saving and loading (ranks, RNG state, the optimizer) stay in
``megatron.training.checkpointing``, on top of this package.
"""

from megatron.checkpointing.errors import CheckpointError, corrupt_file_error
from megatron.checkpointing.files import (CHECKSUM_SUFFIX, HashingWriter, checksum_path,
                                          manifest_entry, manifest_path, publish_tracker,
                                          remove_stale_temp_files, save_file, verify_checksum,
                                          write_manifest)
from megatron.checkpointing.keys import model_keys
from megatron.checkpointing.layout import (BERT_LAYOUT, GPT_LAYOUT, LANGUAGE_MODEL_RULES,
                                           LAYOUTS, CheckpointLayout, TensorRule)
from megatron.checkpointing.names import (DISTRIB_OPTIM_FILENAME, MANIFEST_FILENAME,
                                          MODEL_FILENAME, TRACKER_FILENAME, checkpoint_dir,
                                          any_shard_file, checkpoint_name, expert_shard_files,
                                          latest_checkpoint_dir, parse_tracker, shard_dir_name,
                                          shard_files, tracker_path)
from megatron.checkpointing.safe_load import MegatronEnum, load_checkpoint_file
from megatron.checkpointing.stages import PipelineStages, StageChunk
from megatron.checkpointing.versions import (CHECKPOINT_VERSION, checkpoint_version,
                                             fix_query_key_value_ordering,
                                             qkv_from_current_order, qkv_to_current_order)
from megatron.core.checkpoint_keys import (LANGUAGE_MODEL_NESTED_SECTIONS, flatten_model_state,
                                           nest_model_state)

__all__ = [
    "BERT_LAYOUT", "CHECKPOINT_VERSION", "CHECKSUM_SUFFIX", "DISTRIB_OPTIM_FILENAME", "GPT_LAYOUT",
    "LANGUAGE_MODEL_NESTED_SECTIONS", "LANGUAGE_MODEL_RULES", "LAYOUTS", "MANIFEST_FILENAME",
    "MODEL_FILENAME", "TRACKER_FILENAME", "CheckpointError", "CheckpointLayout", "HashingWriter",
    "MegatronEnum", "PipelineStages", "StageChunk", "TensorRule", "any_shard_file",
    "checkpoint_dir", "checkpoint_name", "checkpoint_version", "checksum_path", "corrupt_file_error",
    "expert_shard_files", "fix_query_key_value_ordering", "flatten_model_state",
    "latest_checkpoint_dir",
    "load_checkpoint_file", "manifest_entry", "manifest_path", "model_keys", "nest_model_state",
    "parse_tracker", "publish_tracker", "qkv_from_current_order", "qkv_to_current_order",
    "remove_stale_temp_files", "save_file", "shard_dir_name", "shard_files", "tracker_path",
    "verify_checksum", "write_manifest",
]
