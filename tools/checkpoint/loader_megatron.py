"""Loader plug-in: a Megatron-LM ``--ckpt-format torch`` checkpoint (ours or Megatron-LM's) at
any TP / PP / virtual-stage / expert-parallel layout -> :class:`~tools.checkpoint.
model_description.ModelDescription`. The ``mp_rank_TT[_PPP]_EEE`` shards of an expert-parallel
checkpoint are merged per TP/PP position: every routed expert under its global index
(``megatron.checkpointing.experts``), the dense tensors from EP rank 0.

Reads with ``weights_only=True`` and the allowlist (``megatron.checkpointing.safe_load``),
verifies each shard against its recorded sha256 when there is one (the iteration's
``checksums.sha256``, or an older ``.sha256`` beside it), and maps the files (``mmap``):
only the pipeline stage being read is open, one stage at a time.
"""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import torch

from megatron.checkpointing import (DISTRIB_OPTIM_FILENAME, LAYOUTS, CheckpointError,
                                    PipelineStages, any_shard_file, checkpoint_version,
                                    expert_shard_files,
                                    fix_query_key_value_ordering, flatten_model_state,
                                    load_checkpoint_file, model_keys, parse_tracker,
                                    shard_dir_name, shard_files, tracker_path, verify_checksum)
from megatron.checkpointing.experts import (dense_expert_rank, expert_file_ranks, expert_of,
                                            merge_expert_parallel, torch_format_layout_error)
from megatron.checkpointing.names import ITERATION_DIR, checkpoint_dir
from megatron.core.checkpoint_keys import (current_key, layer_of, norm_key,
                                           with_layer, without_empty_extra_states)
from tools.checkpoint import optimizer_state
from tools.checkpoint.model_description import ModelDescription, swiglu_from_shards

TOLERATED_EXTRA_KEYS = ("word_embeddings.weight",)
"""Keys some converters write beside the LM head that Megatron-LM's legacy model ignores."""


def find_iteration_dir(load_dir: Path) -> tuple[Path, int, bool]:
    """(iteration directory, iteration, release) of ``--load-dir``: a save root with a tracker,
    or an ``iter_XXXXXXX`` / ``release`` directory itself.

    Raises:
        CheckpointError: neither.
    """
    tracked = parse_tracker(tracker_path(load_dir))
    if tracked is not None:
        return checkpoint_dir(load_dir, *tracked), tracked[0], tracked[1]
    if ITERATION_DIR.fullmatch(load_dir.name):
        release = load_dir.name == "release"
        return load_dir, 0 if release else int(load_dir.name[5:]), release
    raise CheckpointError(f"--load-dir {load_dir} holds no latest_checkpointed_iteration.txt "
                          "and is not an iter_XXXXXXX or release directory")


def as_namespace(args) -> argparse.Namespace:
    """``args`` as other tools store them (``argparse.Namespace``, ``types.SimpleNamespace``, a
    dict) -> an ``argparse.Namespace``."""
    if isinstance(args, argparse.Namespace):
        return args
    if isinstance(args, types.SimpleNamespace):
        return argparse.Namespace(**vars(args))
    if isinstance(args, dict):
        return argparse.Namespace(**args)
    raise CheckpointError(f"the checkpoint's args are a {type(args).__name__}, not a namespace")


class MegatronCheckpoint(ModelDescription):
    """A Megatron checkpoint on disk, read one pipeline stage at a time (with
    ``keep_optimizer``, its optimizer state too)."""

    def __init__(self, load_dir: str | Path, family: str, verify: bool = True,
                 keep_optimizer: bool = False) -> None:
        load_dir = Path(load_dir)
        self.iteration_dir, iteration, release = find_iteration_dir(load_dir)
        first_path = any_shard_file(self.iteration_dir)
        if first_path is None:
            raise CheckpointError(f"{self.iteration_dir} holds no mp_rank_*/model_optim_rng.pt")
        self.verify = verify
        self._verified: set[Path] = set()
        first = self._read(first_path)
        self._first_path = first_path
        if "args" not in first:
            raise CheckpointError(f"{first_path} holds no args: the "
                                  "architecture (num_layers, hidden_size...) is unknown")
        args = as_namespace(first["args"])
        self.ep = int(getattr(args, "expert_model_parallel_size", None) or 1)
        self.expert_files = self._find_files(args)
        self.files = {}  # (t, p) -> a file holding TP rank t's dense slice
        for (t, p, e), path in sorted(self.expert_files.items()):
            self.files.setdefault((t, p), path)
        self.tp, self.pp = _grid_size(args, self.files)
        self.etp = _expert_tensor_split(args, self.tp, self.iteration_dir)
        self._check_grid()
        chunks = len(model_keys(first))
        self._check_virtual_stages(args, chunks)
        self._check_family(family, first)
        self.version = checkpoint_version(first)
        super().__init__(family=family, args=args, iteration=int(first.get(
            "iteration", first.get("total_iters", iteration)) if not release else 0),
            release=release, extra=_extras(first),
            true_vocab_size=_true_vocab_size(args))
        self.layout = LAYOUTS[family]
        self.stages = PipelineStages(self.num_layers, self.pp, chunks if chunks > 1 else None)
        self.plan = self.stages.chunks()
        self._open_stage: int | None = None
        self._flat: list[list[dict[str, torch.Tensor]]] = []  # [chunk of stage][tp] -> flat
        # [chunk of stage][tp][ep] -> flat with local expert indices
        self._local_flat: list[list[list[dict[str, torch.Tensor]]]] = []
        # [chunk of stage] -> {(t, e): flat of that file}
        self._file_flat: list[dict[tuple[int, int], dict[str, torch.Tensor]]] = []
        # [chunk of stage][tp] -> {state key: flat}, with keep_optimizer
        self._optimizer_flat: list[list[dict[str, dict[str, torch.Tensor]]]] = []
        if keep_optimizer:
            self.optimizer = self._describe_optimizer(first)
        del first

    def _describe_optimizer(self, first: dict) -> optimizer_state.OptimizerDescription:
        path = self.files[min(self.files)]
        if self.version is None or self.version < 2.0:
            raise CheckpointError(f"--keep-optimizer-state: {path} has checkpoint_version "
                                  f"{self.version} (QKV rows in an older order, which its "
                                  "optimizer state would need too); convert without it")
        return optimizer_state.describe(first, self.args, path,
                                        path.with_name(DISTRIB_OPTIM_FILENAME))

    # Files --------------------------------------------------------------------------------
    def _find_files(self, args) -> dict[tuple[int, int, int], Path]:
        """Every shard by (TP, PP, EP rank). Without expert parallelism the PP size may come
        from the directory names (Megatron-LM checkpoints without it in their args)."""
        if self.ep == 1:
            return {(t, p, 0): path for (t, p), path in shard_files(self.iteration_dir).items()}
        num_experts = int(getattr(args, "num_experts", None) or 0)
        if num_experts % self.ep:
            raise CheckpointError(f"{self.iteration_dir}: its args record --num-experts "
                                  f"{num_experts} over --expert-model-parallel-size {self.ep}")
        pp = int(getattr(args, "pipeline_model_parallel_size", None) or 1)
        return expert_shard_files(self.iteration_dir, pp > 1, True)

    def _written_ranks(self) -> list[tuple[int, int]]:
        """The (TP rank, EP rank) pairs of a stage's files: those of the ranks of
        expert-data-parallel rank 0, in-stage ranks r < ETP x EP (TP rank r % TP, EP rank
        r // ETP), each file holding its TP slice of the dense layers and its EP rank's
        experts' ETP slice r % ETP (every pair when ETP = TP)."""
        return sorted({(r % self.tp, r // self.etp) for r in range(self.etp * self.ep)})

    def _check_grid(self) -> None:
        if self.ep > 1 or self.etp != self.tp:
            why = torch_format_layout_error(self.tp, self.etp, self.ep)
            if why is not None:
                raise CheckpointError(
                    f"{self.iteration_dir} was saved with --expert-tensor-parallel-size "
                    f"{self.etp}, --tensor-model-parallel-size {self.tp} and "
                    f"--expert-model-parallel-size {self.ep}: {why}, a layout the torch "
                    "format's files do not hold (a mixed-up directory?): not converted")
        missing = [shard_dir_name(t, p, self.pp > 1, e, self.ep > 1)
                   for t, e in self._written_ranks() for p in range(self.pp)
                   if (t, p, e) not in self.expert_files]
        extra = [shard_dir_name(t, p, self.pp > 1, e, self.ep > 1)
                 for t, p, e in self.expert_files if e >= self.ep]
        if extra:
            raise CheckpointError(
                f"{self.iteration_dir} holds {', '.join(sorted(extra))}, beyond the "
                f"--expert-model-parallel-size {self.ep} its args record: files of two layouts "
                "mixed, not converted")
        if missing:
            raise CheckpointError(
                f"{self.iteration_dir} lacks the shard director{'ies' if len(missing) > 1 else 'y'}"
                f" {', '.join(missing)} (a TP {self.tp} x PP {self.pp} x EP {self.ep} checkpoint "
                "needs every mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt): incomplete copy or save")

    def _check_virtual_stages(self, args: argparse.Namespace, chunks: int) -> None:
        """The model chunks per shard are the virtual stages the args record."""
        expected = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
        if chunks != expected:
            path = self.files[min(self.files)]
            raise CheckpointError(
                f"{path} holds {chunks} model chunk(s), but its args record "
                f"virtual_pipeline_model_parallel_size {expected}: a damaged or mixed-up "
                "checkpoint, not converted")

    def _check_family(self, family: str, first: dict) -> None:
        """``--model-type`` matches the model saved: BERT's last stage always holds a tensor
        GPT's layout lacks (pooler, LM head, task head), and GPT's never does. Checked before
        any stage is read, so a wrong ``--model-type`` writes nothing."""
        path = self.files[(0, self.pp - 1)]
        last = first if path == self._first_path else self._read(path)
        keys = [key for name in model_keys(last) for key in flatten_model_state(last[name])]
        bert_only = sorted(set(LAYOUTS["GPT"].unknown_keys(keys))
                           - set(LAYOUTS["BERT"].unknown_keys(keys)))
        if family == "BERT" and not bert_only:
            raise CheckpointError(
                f"--model-type BERT, but {path} holds no pooler, LM head or task head: it is "
                "a GPT checkpoint; use --model-type GPT")
        if family == "GPT" and bert_only:
            raise CheckpointError(
                f"--model-type GPT, but {path} holds BERT's {', '.join(bert_only[:3])}"
                f"{' ...' if len(bert_only) > 3 else ''}: it is a BERT checkpoint; use "
                "--model-type BERT")

    def _read(self, path: Path) -> dict:
        if self.verify and path not in self._verified:
            verify_checksum(path)
            self._verified.add(path)  # hashing a shard once is enough (stages are re-read)
        return load_checkpoint_file(path, mmap=True)

    def _stage(self, pipeline_rank: int) -> None:
        """Open ``pipeline_rank``'s shards (all TP ranks), closing the stage open before."""
        if self._open_stage == pipeline_rank:
            return
        self._flat, self._local_flat, self._file_flat = [], [], []
        self._open_stage = None
        self._open_pipeline_rank = pipeline_rank
        files = {(t, e): self.expert_files[(t, pipeline_rank, e)]
                 for t, e in self._written_ranks()}
        read = {key: self._read(path) for key, path in files.items()}
        version = 0.0 if self.version is None else self.version
        for key, sd in read.items():
            fix_query_key_value_ordering(sd, version, int(self.args.num_attention_heads),
                                         self.tp, str(files[key]))
        # [tp][ep] -> (file of TP rank t's dense slice, file of EP rank e's experts): one file
        # when the experts are split over TP.
        pairs = [[self._files_of(t, e, files) for e in range(self.ep)] for t in range(self.tp)]
        paths = [[files[dense] for dense, _ in per_ep] for per_ep in pairs]
        chunks = [c for c in self.plan if c.pipeline_rank == pipeline_rank]
        for chunk in chunks:
            own = {}  # file -> its flat dict, local expert indices
            for key, sd in read.items():
                if chunk.model_key not in sd:
                    raise CheckpointError(f"{files[key]} has no '{chunk.model_key}' entry")
                own[key] = self._known(flatten_model_state(sd[chunk.model_key]), chunk,
                                       files[key])
            local = [[_combined(own[dense], own[experts]) for dense, experts in per_ep]
                     for per_ep in pairs]  # [tp][ep]
            self._local_flat.append(local)
            self._file_flat.append(own)
            self._flat.append([self._merge_experts(per_ep, paths[0][0].parent)
                               for per_ep in local])
        if self.optimizer is not None:
            self._read_optimizer_stage(read, files, pairs)
        self._open_stage = pipeline_rank

    def _files_of(self, t: int, e: int, files: dict) -> tuple[tuple[int, int], tuple[int, int]]:
        """(the file key of TP rank t's dense slice, that of EP rank e's experts' ETP slice
        t % ETP): one file when that one holds TP rank t's dense slice too."""
        experts = expert_file_ranks(self.tp, t % self.etp, self.etp, e)
        if experts[0] == t:
            return experts, experts
        dense = (t, dense_expert_rank(t, self.tp, self.etp))
        assert dense in files and experts in files, (dense, experts)
        return dense, experts

    def _merge_experts(self, per_ep: list[dict], where) -> dict:
        """The EP ranks' dicts of one TP/PP position -> one, experts numbered globally."""
        return per_ep[0] if self.ep == 1 else merge_expert_parallel(per_ep, str(where))

    def _read_optimizer_stage(self, read: dict, files: dict, pairs: list[list[tuple]]
                              ) -> None:
        """The open stage's per-parameter optimizer state, per chunk and TP rank (each file's
        read against its own local weights, then combined and merged as the weights are)."""
        per_file = {}  # file key -> [chunk] -> {state key: flat}
        for key, sd in read.items():
            t, e = key
            distrib = None
            if self.optimizer.distributed:
                distrib = self._read_distrib(t, e)
            chunks = [own[key] for own in self._file_flat]
            per_file[key] = optimizer_state.read_shard(sd, chunks, self.optimizer, distrib,
                                                       files[key])
        self._optimizer_flat = [
            [{name: self._merge_experts(
                [_combined(per_file[dense][c][name], per_file[experts][c][name])
                 for dense, experts in pairs[t]], files[pairs[t][0][0]].parent)
              for name in per_file[pairs[t][0][0]][c]} for t in range(self.tp)]
            for c in range(len(self._flat))]

    def _read_distrib(self, tp_rank: int, ep_rank: int) -> dict:
        """The ``distrib_optim.pt`` of file (``tp_rank``, ``ep_rank``) (with expert
        parallelism: the dense state from the file of TP rank ``tp_rank``'s data-parallel rank
        0, the expert state from its own)."""
        pipeline_rank = self._open_pipeline_rank
        path = self.expert_files[(tp_rank, pipeline_rank, ep_rank)]
        if self.ep == 1:
            return self._read(path.with_name(DISTRIB_OPTIM_FILENAME))
        dense_ep = dense_expert_rank(tp_rank, self.tp, self.etp)
        dense = self._read(self.expert_files[(tp_rank, pipeline_rank, dense_ep)].with_name(
            DISTRIB_OPTIM_FILENAME))
        if not isinstance(dense, list):
            return dense  # a pipeline stage without MoE layers: its dense state alone
        own = dense if ep_rank == dense_ep else self._read(path.with_name(DISTRIB_OPTIM_FILENAME))
        return optimizer_state.expert_parallel_distrib(dense, own, path)

    def _known(self, flat: dict, chunk, path: Path) -> dict[str, torch.Tensor]:
        """Drop the extra keys Megatron tolerates; refuse others the layout does not know."""
        flat = {norm_key(k): v for k, v in without_empty_extra_states(flat).items()}
        for key in TOLERATED_EXTRA_KEYS:
            if key in flat and chunk.pre_process and chunk.post_process:
                del flat[key]
        self.layout.check_keys(flat, str(path))
        return {current_key(k): v for k, v in flat.items()}

    def _stage_position(self, index: int) -> int:
        """Open chunk ``index``'s stage; its position among the stage's chunks."""
        chunk = self.plan[index]
        self._stage(chunk.pipeline_rank)
        stage_chunks = [i for i, c in enumerate(self.plan)
                        if c.pipeline_rank == chunk.pipeline_rank]
        return stage_chunks.index(index)

    def _merged(self, per_tp: list[dict], keep) -> dict[str, torch.Tensor]:
        subset = [{k: v for k, v in flat.items() if keep(k)} for flat in per_tp]
        whole_experts = {}
        if self.etp != self.tp:
            # TP rank t's dict holds the experts' ETP slice t % ETP: TP ranks 0..ETP-1 hold
            # each slice once.
            whole_experts = self._merged_over(
                [{k: v for k, v in flat.items() if expert_of(k) is not None}
                 for flat in subset[:self.etp]])
            subset = [{k: v for k, v in flat.items() if expert_of(k) is None}
                      for flat in subset]
        merged = self._merged_over(subset)
        if not whole_experts:
            return merged
        position = {k: i for i, k in enumerate(per_tp[0])}
        merged.update(whole_experts)
        return {k: merged[k] for k in sorted(merged, key=position.__getitem__)}

    def _merged_over(self, shards: list[dict]) -> dict[str, torch.Tensor]:
        """The whole tensors of one split's shards (TP's, or the experts' ETP)."""
        if len(shards) == 1:
            return shards[0]
        merged = self.layout.merge_tensor_parallel(shards)
        if getattr(self.args, "swiglu", False):
            merged = swiglu_from_shards(merged, len(shards))  # [gate_r; up_r] -> whole
        return merged

    def _piece_source(self, piece: str, layer: int | None):
        """(chunk index, which of its keys, how to rename them) of a piece."""
        if piece == "embeddings":
            index = next(i for i, c in enumerate(self.plan) if c.pre_process)
            return index, lambda k: k.startswith("language_model.embedding."), dict
        if piece == "layer":
            index = self.stages.chunk_index_of_layer(layer)
            local = layer - self.plan[index].first_layer

            def renumbered(merged: dict) -> dict:
                return {with_layer(k, layer): v for k, v in merged.items()}
            return index, lambda k: layer_of(k) == local, renumbered
        index = next(i for i, c in enumerate(self.plan) if c.post_process)

        def keep(key: str) -> bool:
            rule = self.layout.rule(key)
            return rule.stage == "last" and rule.copy_of is None
        return index, keep, dict

    def _piece(self, piece: str, layer: int | None = None) -> dict[str, torch.Tensor]:
        index, keep, rename = self._piece_source(piece, layer)
        position = self._stage_position(index)  # opens the stage: before reading _flat
        return rename(self._merged(self._flat[position], keep))

    # Pieces ---------------------------------------------------------------------------------
    def embeddings(self) -> dict[str, torch.Tensor]:
        return self._piece("embeddings")

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        return self._piece("layer", index)

    def head(self) -> dict[str, torch.Tensor]:
        return self._piece("head")

    def optimizer_state(self, piece: str, layer: int | None = None
                        ) -> dict[str, dict[str, torch.Tensor]]:
        index, keep, rename = self._piece_source(piece, layer)
        position = self._stage_position(index)
        per_tp = self._optimizer_flat[position]
        return {name: rename(self._merged([state[name] for state in per_tp], keep))
                for name in per_tp[0]}

    def close(self) -> None:
        self._flat, self._local_flat, self._optimizer_flat, self._file_flat = [], [], [], []
        self._open_stage = None


def _grid_size(args: argparse.Namespace, files: dict[tuple[int, int], Path]) -> tuple[int, int]:
    """(TP, PP) of the checkpoint: as its args record them (Megatron-LM's and ours do), else as
    its directories suggest. A shard directory beyond the recorded grid is refused: the files
    of two layouts mixed in one directory."""
    found_tp = 1 + max(t for t, _ in files)
    found_pp = 1 + max(p for _, p in files)
    tp = getattr(args, "tensor_model_parallel_size", None) or found_tp
    pp = getattr(args, "pipeline_model_parallel_size", None) or found_pp
    extra = sorted(shard_dir_name(t, p, found_pp > 1) for t, p in files if t >= tp or p >= pp)
    if extra:
        raise CheckpointError(
            f"{files[min(files)].parent.parent} holds {', '.join(extra)}, beyond the TP {tp} x "
            f"PP {pp} its args record: files of two layouts mixed, not converted")
    return tp, pp


def _expert_tensor_split(args, tp: int, where: Path) -> int:
    """The checkpoint's expert tensor-parallel size (TP where its args record none).

    Raises:
        CheckpointError: a size that is not a positive integer.
    """
    etp = getattr(args, "expert_tensor_parallel_size", None)
    if not getattr(args, "num_experts", None) or etp is None:
        return tp
    if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1:
        raise CheckpointError(f"{where}: its args record --expert-tensor-parallel-size "
                              f"{etp!r}, not a positive integer")
    return etp


def _combined(dense: dict, experts: dict) -> dict:
    """One rank's flat dict from the file of its dense slice and the file of its experts (the
    same keys: the experts' local indices agree), in ``dense``'s order."""
    return {k: (experts[k] if expert_of(k) is not None else v) for k, v in dense.items()}


def _true_vocab_size(args) -> int | None:
    """The unpadded vocabulary a conversion recorded (``args.true_vocab_size``: an HF import's
    ``vocab_size``), so every later export drops exactly the padding rows."""
    value = getattr(args, "true_vocab_size", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _extras(sd: dict) -> dict:
    out = {}
    if "num_floating_point_operations_so_far" in sd:
        out["num_floating_point_operations_so_far"] = sd["num_floating_point_operations_so_far"]
    if sd.get("rng_state"):
        # The Python / numpy / torch generators; the per-TP-rank model-parallel tracker streams
        # do not carry over to another TP layout (the loading run keeps its seeded ones).
        out["rng_state"] = [{k: v for k, v in state.items() if k != "rng_tracker_states"}
                            for state in sd["rng_state"]]
    return out


def load(load_dir: str | Path, family: str, verify: bool = True,
         keep_optimizer: bool = False) -> MegatronCheckpoint:
    """The loader's entry point (``--loader megatron``)."""
    return MegatronCheckpoint(load_dir, family, verify, keep_optimizer)
