"""Convert a checkpoint: another TP / PP / virtual-stage / expert-parallel layout, or to / from
HuggingFace.

Megatron-LM's ``tools/checkpoint/convert.py`` interface::

    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver megatron \\
        --load-dir ckpt/tp1 --save-dir ckpt/tp2pp2 \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2

A mixture-of-experts checkpoint's experts are re-split with ``--target-expert-parallel-size``
(Megatron-LM's flag; default 1: every expert in each ``mp_rank_TT[_PPP]`` file) and
``--target-expert-tensor-parallel-size`` (each expert split over this many ranks, default the
target TP; any ETP with ETP <= TP <= ETP x EP, the layouts the torch format's files hold); the
source's sizes are read from its args.

A loader plug-in (``loader_megatron``, ``loader_hf``) describes the model
(:class:`~tools.checkpoint.model_description.ModelDescription`); a saver plug-in
(``saver_megatron``, ``saver_hf``) pulls its pieces a pipeline stage / layer at a time and writes
them. No process group is started; nothing is downloaded.

The optimizer state is dropped, as Megatron-LM's tool drops it, unless ``--keep-optimizer-state``:
then Adam's moments (and the fp32 main params of fp16/bf16 runs) are re-split with their
parameters, the step count, grad scaler and LR scheduler carried, and the result resumes with
``--load`` as the source would have; ``--[no-]target-use-distributed-optimizer`` switches between
the plain and the distributed optimizer's layout (any data-parallel size loads the latter).
With ``--source-ckpt-format`` / ``--target-ckpt-format torch_dist`` the state goes through
Megatron-Core's reshardable ``optimizer.state.*`` tensors (``tools.checkpoint.dist_format``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.checkpointing import CheckpointError  # noqa: E402
from megatron.core.log import get_logger  # noqa: E402

_log = get_logger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Megatron checkpoint converter (TP/PP layouts, HuggingFace import/export)")
    parser.add_argument("--model-type", required=True, choices=["GPT", "BERT"])
    parser.add_argument("--loader", default="megatron", choices=["megatron", "hf"],
                        help="source format")
    parser.add_argument("--saver", default="megatron", choices=["megatron", "hf"],
                        help="target format")
    parser.add_argument("--load-dir", required=True,
                        help="source: a --save root (tracker file), an iter_XXXXXXX/release "
                             "directory, or a local HuggingFace model directory")
    parser.add_argument("--save-dir", required=True, help="target directory (must be empty)")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1)
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--target-expert-parallel-size", type=int, default=1,
                        help="MoE: split the routed experts over this many expert-parallel "
                             "ranks (mp_rank_TT[_PPP]_EEE directories); default 1")
    parser.add_argument("--target-expert-tensor-parallel-size", type=int, default=None,
                        help="MoE: split each routed expert over this many ranks "
                             "(Megatron's --expert-tensor-parallel-size; default the target "
                             "TP size); the torch format holds ETP <= TP <= ETP x EP")
    parser.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None,
                        help="virtual pipeline stages of the target (interleaved schedule)")
    parser.add_argument("--target-vocab-size-divisible-by", type=int, default=None,
                        help="pad the vocabulary to a multiple of this x target TP (default: "
                             "keep the source's padding when it splits over the target TP)")
    parser.add_argument("--true-vocab-size", type=int, default=None,
                        help="the tokenizer's vocabulary before padding (HF export drops the "
                             "rows past it; re-padding starts from it)")
    parser.add_argument("--keep-padded-vocab", action="store_true",
                        help="HF export: keep the padding rows of the vocabulary")
    parser.add_argument("--keep-optimizer-state", action="store_true",
                        help="carry the optimizer state (Adam moments, fp32 main params, step, "
                             "grad scaler, LR scheduler), re-split for the target layout "
                             "(Megatron-LM's converter drops it)")
    parser.add_argument("--target-use-distributed-optimizer",
                        action=argparse.BooleanOptionalAction, default=None,
                        help="write the optimizer state in the distributed optimizer's layout "
                             "(distrib_optim.pt, loadable at any data-parallel size) or, with "
                             "--no-target-use-distributed-optimizer, the plain one (default: "
                             "as the source)")
    parser.add_argument("--source-ckpt-format", default="torch", choices=["torch", "torch_dist"],
                        help="--loader megatron: the source's --ckpt-format (torch_dist: "
                             "Megatron-Core's dist_checkpointing directory)")
    parser.add_argument("--target-ckpt-format", default="torch", choices=["torch", "torch_dist"],
                        help="--saver megatron: the target's --ckpt-format (torch_dist loads at "
                             "any TP/PP layout: leave the target sizes at 1)")
    parser.add_argument("--no-checksum-verification", action="store_true",
                        help="do not check the source shards against their recorded sha256s "
                             "(checksums.sha256)")
    parser.add_argument("--megatron-path", default=None,
                        help="accepted for Megatron-LM compatibility and ignored")
    parser.add_argument("--hf-architecture", default=None,
                        choices=["GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM",
                                 "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                 "MegatronBertForPreTraining", "BertForPreTraining"],
                        help="HF export: the class to write (default: the one the checkpoint "
                             "needs: BERT trained with --apply-residual-connection-post-layernorm"
                             " -> BertForPreTraining, else MegatronBertForPreTraining; a Mistral "
                             "import -> MistralForCausalLM with its sliding window; "
                             "MistralForCausalLM holds any other Llama-style GPT without one)")
    parser.add_argument("--tokenizer-dir", default=None,
                        help="HF export: copy the tokenizer files from here (else the "
                             "checkpoint's --vocab-file / --merge-file)")
    return parser


def _validate(opts: argparse.Namespace) -> None:
    for name in ("target_tensor_parallel_size", "target_pipeline_parallel_size",
                 "target_expert_parallel_size", "target_expert_tensor_parallel_size"):
        if getattr(opts, name) is not None and getattr(opts, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if opts.target_expert_parallel_size > 1 and (opts.saver != "megatron"
                                                 or opts.target_ckpt_format != "torch"):
        raise ValueError("--target-expert-parallel-size > 1 needs --saver megatron with "
                         "--target-ckpt-format torch (a HuggingFace model and a torch_dist "
                         "checkpoint hold every expert whole)")
    if opts.saver == "hf" and (opts.target_tensor_parallel_size != 1
                               or opts.target_pipeline_parallel_size != 1):
        raise ValueError("--saver hf writes one unsplit model: leave "
                         "--target-tensor-parallel-size / --target-pipeline-parallel-size at 1")
    if opts.keep_optimizer_state and "hf" in (opts.loader, opts.saver):
        raise ValueError("--keep-optimizer-state needs --loader megatron --saver megatron "
                         "(a HuggingFace model directory holds no optimizer state)")
    if opts.hf_architecture is not None and opts.saver != "hf":
        raise ValueError("--hf-architecture needs --saver hf")
    if opts.target_use_distributed_optimizer is not None and opts.saver != "megatron":
        raise ValueError("--[no-]target-use-distributed-optimizer needs --saver megatron")
    dist_sides = [side for side, fmt in (("--source-ckpt-format", opts.source_ckpt_format),
                                         ("--target-ckpt-format", opts.target_ckpt_format))
                  if fmt == "torch_dist"]
    if dist_sides and "hf" in (opts.loader, opts.saver):
        raise ValueError(f"{dist_sides[0]} torch_dist needs --loader megatron --saver megatron")
    if opts.target_ckpt_format == "torch_dist" and (
            opts.target_tensor_parallel_size != 1 or opts.target_pipeline_parallel_size != 1
            or opts.target_expert_tensor_parallel_size not in (None, 1)
            or opts.target_num_layers_per_virtual_pipeline_stage is not None):
        raise ValueError("--target-ckpt-format torch_dist has no layout (it loads at any TP/PP): "
                         "leave the --target-*-parallel-size flags at 1")
    if opts.target_num_layers_per_virtual_pipeline_stage is not None \
            and opts.target_pipeline_parallel_size < 2:
        raise ValueError("--target-num-layers-per-virtual-pipeline-stage needs "
                         "--target-pipeline-parallel-size > 1 (as Megatron-LM's interleaved "
                         "schedule)")


def load_model(opts: argparse.Namespace):
    """The loader plug-in's model description."""
    if opts.loader == "megatron":
        from tools.checkpoint import loader_megatron
        md = loader_megatron.load(opts.load_dir, opts.model_type,
                                  verify=not opts.no_checksum_verification,
                                  keep_optimizer=opts.keep_optimizer_state)
    else:
        from tools.checkpoint import loader_hf
        md = loader_hf.load(opts.load_dir, opts.model_type)
    if opts.true_vocab_size is not None:
        if not 0 < opts.true_vocab_size <= md.padded_vocab_size:
            md.close()
            raise ValueError(f"--true-vocab-size {opts.true_vocab_size} must be between 1 and "
                             f"the checkpoint's {md.padded_vocab_size} word-embedding rows (the "
                             "tokenizer's vocabulary before padding)")
        md.true_vocab_size = opts.true_vocab_size
    return md


def refuse_unconverted_architecture(md, opts: argparse.Namespace) -> None:
    """Llama-style checkpoints a target cannot hold, refused before anything is
    written. ``--saver hf`` checks its own class (GPT-2 or Llama, ``hf_llama``); ``--saver
    megatron`` re-splits whole key/value groups per TP rank, so the target TP size must divide
    the query groups (SwiGLU's fc1 is re-split per rank as [gate_r; up_r]).

    Raises:
        ValueError: naming the checkpoint's flag and the target.
    """
    a = md.args
    if opts.saver == "hf":
        return
    target_tp = opts.target_tensor_parallel_size
    groups = getattr(a, "num_query_groups", None)
    if getattr(a, "group_query_attention", False) and groups and int(groups) % target_tp:
        raise ValueError(f"--target-tensor-parallel-size {target_tp} does not divide the "
                         f"checkpoint's --num-query-groups {groups}")
    if getattr(a, "qk_layernorm_full_projection", False) and target_tp > 1:
        raise ValueError(f"--target-tensor-parallel-size {target_tp}: the checkpoint's "
                         "--qk-layernorm-full-projection (q/k norms over all heads) runs at "
                         "TP=1 only")


def save_model(md, opts: argparse.Namespace):
    """Run the saver plug-in."""
    refuse_unconverted_architecture(md, opts)
    if opts.saver == "megatron":
        from tools.checkpoint import saver_megatron
        saver_megatron.refuse_existing(Path(opts.save_dir))
        target = saver_megatron.TargetLayout(
            opts.target_tensor_parallel_size, opts.target_pipeline_parallel_size,
            opts.target_num_layers_per_virtual_pipeline_stage,
            opts.target_vocab_size_divisible_by, opts.target_use_distributed_optimizer,
            opts.target_expert_parallel_size, opts.target_expert_tensor_parallel_size)
        return saver_megatron.save(md, opts.save_dir, target)
    from tools.checkpoint import saver_hf
    return saver_hf.save(md, opts.save_dir, keep_padded_vocab=opts.keep_padded_vocab,
                         tokenizer_dir=opts.tokenizer_dir, architecture=opts.hf_architecture)


def _convert(opts: argparse.Namespace, scratch: Path):
    """Load, save; a torch_dist side goes through a TP1.PP1 torch checkpoint in ``scratch``."""
    from tools.checkpoint import dist_format
    opts = argparse.Namespace(**vars(opts))
    if opts.source_ckpt_format == "torch_dist":
        opts.load_dir = str(dist_format.torch_dist_to_legacy(
            Path(opts.load_dir), scratch / "source", keep_optimizer=opts.keep_optimizer_state,
            family=opts.model_type))
    target = opts.save_dir
    if opts.target_ckpt_format == "torch_dist":
        from tools.checkpoint import saver_megatron
        saver_megatron.refuse_existing(Path(target))
        opts.save_dir = str(scratch / "target")
    md = load_model(opts)
    try:
        out = save_model(md, opts)
    finally:
        md.close()
    if opts.target_ckpt_format == "torch_dist":
        dist_format.legacy_to_torch_dist(Path(opts.save_dir), Path(target), opts.model_type)
        out = target
    return out


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        _validate(opts)
        with tempfile.TemporaryDirectory(prefix="convert_torch_dist_") as scratch:
            out = _convert(opts, Path(scratch))
    except (ValueError, OSError) as err:  # CheckpointError is a ValueError
        sys.stderr.write(f"convert.py: error: {err}\n")
        return 2
    _log.info("converted %s (%s) -> %s (%s) in %.1f s", opts.load_dir, opts.loader, out,
              opts.saver, time.perf_counter() - start)
    return 0


__all__ = ["CheckpointError", "build_parser", "load_model", "main",
           "refuse_unconverted_architecture", "save_model"]

if __name__ == "__main__":
    sys.exit(main())
