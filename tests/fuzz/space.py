"""The fuzzer's space: declarative dimensions, their flags, and draws the project's own
validation accepts.

A configuration is a plain dict ``{dimension name: value}`` (JSON-serializable: it is what a
failure prints and what ``python -m tests.fuzz --config`` replays). Each :class:`Dimension`
lists its values (the first is the baseline, what minimization falls back to), their draw
weights, and the pretrain flags a value adds. A draw picks every dimension independently, then
``megatron.config.validate`` (and pretrain_bert.py's own flag checks for BERT) decides: a
refused draw is recorded with validation's message and redrawn. Nothing here encodes which
combinations are legal; the fuzzer's own limits are only the world size (ranks on this machine)
and the resume layout keeping the world size (one pooled world per draw).

Adding a dimension (expert parallelism, context parallelism, a checkpoint format) is one entry
in :data:`DIMENSIONS` with its flags; a dimension that splits the model over ranks also names
its size in :func:`world_size`. The reference run (one process) is the same configuration with
every ``layout`` dimension at its baseline.
"""

from __future__ import annotations

import dataclasses
import random
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

Config = dict[str, Any]

ITERS = 3
SEQ = 32
HIDDEN = ["--hidden-size", "64", "--num-attention-heads", "4"]
# Llama-style GPT as tests/training/test_llama.py (the tied/untied choice is its own dimension).
LLAMA = ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
         "--ffn-hidden-size", "96", "--position-embedding-type", "rope", "--rotary-percent",
         "0.5", "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear"]
BERT_VOCAB = 1023  # NullTokenizer ids of tests/training/test_bert_pretrain.py's samples


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One axis of the space.

    Attributes:
        name: the key in a configuration.
        values: the values; ``values[0]`` is the baseline (minimization falls back to it).
        flags: the pretrain flags of a value (given the whole configuration, for values whose
            flags depend on another dimension's).
        weights: draw weights of ``values`` (uniform when None).
        layout: a parallel-layout dimension: the one-process reference takes its baseline, and
            a resume at another layout redraws it.
    """

    name: str
    values: tuple
    flags: Callable[[Any, Config], list[str]]
    weights: tuple[float, ...] | None = None
    layout: bool = True

    def draw(self, rng: random.Random) -> Any:
        return rng.choices(self.values, weights=self.weights)[0]


def _switch(*flags: str) -> Callable[[Any, Config], list[str]]:
    """Flags present when the value is true."""
    return lambda value, cfg: list(flags) if value else []


def _sized(flag: str) -> Callable[[Any, Config], list[str]]:
    """``flag value`` unless the value is None."""
    return lambda value, cfg: [] if value is None else [flag, str(value)]


MOE = ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2"]


def _moe_flags(value, cfg: Config) -> list[str]:
    """A mixture-of-experts model of ``value`` experts (None: dense)."""
    if not value:
        return []
    # Top-1 of a softmax over one score has no router gradient: softmax before the top-k then.
    top1 = ["--moe-router-pre-softmax"] if cfg["moe_topk"] == 1 else []
    return ["--num-experts", str(value), "--moe-router-topk", str(cfg["moe_topk"]), *MOE, *top1]


def _sized_moe(flag: str) -> Callable[[Any, Config], list[str]]:
    """``flag value`` in a mixture-of-experts model (the size is given when not 1, so that
    validation sees and judges it in a dense model too)."""
    return lambda value, cfg: [flag, str(value)] if value != 1 else []


_RECOMPUTE = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full-uniform-1": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "1"],
    "full-uniform-2": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "2"],
    "full-block-1": ["--recompute-granularity", "full", "--recompute-method", "block",
                     "--recompute-num-layers", "1"],
    "full-block-2": ["--recompute-granularity", "full", "--recompute-method", "block",
                     "--recompute-num-layers", "2"],
    # Refused by validation (full needs a method): keeps that refusal exercised.
    "full-no-method": ["--recompute-granularity", "full"],
}

DIMENSIONS: tuple[Dimension, ...] = (
    # The model (same in the reference) -------------------------------------------------------
    Dimension("family", ("gpt", "llama", "bert"), lambda v, c: LLAMA if v == "llama" else [],
              layout=False),
    Dimension("untied", (False, True), _switch("--untie-embeddings-and-output-weights"),
              layout=False),
    Dimension("num_layers", (4, 2, 8), lambda v, c: ["--num-layers", str(v)],
              weights=(3, 1, 1), layout=False),
    Dimension("micro_batch_size", (1, 2), lambda v, c: ["--micro-batch-size", str(v)],
              layout=False),
    # Mixture of experts (GPT and Llama-style; validation refuses the rest): every layer's MLP
    # is experts routed top-k with the aux loss, whose gradients the parameters compare.
    Dimension("num_experts", (None, 4), _moe_flags, weights=(3, 1), layout=False),
    Dimension("moe_topk", (2, 1), lambda v, c: [], layout=False),  # in _moe_flags
    # Not in the reference either: compiled layers must give the eager losses.
    Dimension("compile_layers", (False, True), _switch("--compile-layers"), weights=(6, 1)),
    # The layout (baseline in the reference) ---------------------------------------------------
    Dimension("tp", (1, 2, 4), lambda v, c: ["--tensor-model-parallel-size", str(v)]),
    Dimension("pp", (1, 2, 4), lambda v, c: ["--pipeline-model-parallel-size", str(v)]),
    Dimension("dp", (1, 2, 4), lambda v, c: []),  # the world size's remaining factor
    Dimension("cp", (1, 2, 4), lambda v, c: ["--context-parallel-size", str(v)],
              weights=(3, 2, 1)),
    Dimension("cp_comm_type", ("p2p", "all_gather", "a2a"),
              lambda v, c: ["--cp-comm-type", v] if c["cp"] > 1 else []),
    # Expert parallelism splits the experts over DP (x CP) ranks: not in world_size.
    Dimension("ep", (1, 2, 4), _sized_moe("--expert-model-parallel-size"), weights=(3, 2, 1)),
    # The experts' own tensor-parallel split (parallel folding); None: TP's.
    Dimension("etp", (None, 1, 2), _sized("--expert-tensor-parallel-size"), weights=(4, 1, 1)),
    Dimension("moe_dispatcher", ("allgather", "alltoall"),
              lambda v, c: ["--moe-token-dispatcher-type", v] if c["num_experts"] else []),
    Dimension("layers_per_virtual_stage", (None, 1, 2),
              _sized("--num-layers-per-virtual-pipeline-stage"), weights=(2, 1, 1)),
    Dimension("microbatches", (1, 2, 4), lambda v, c: []),  # in --global-batch-size
    Dimension("sequence_parallel", (False, True), _switch("--sequence-parallel")),
    Dimension("distributed_optimizer", (False, True), _switch("--use-distributed-optimizer")),
    Dimension("overlap_grad_reduce", (False, True), _switch("--overlap-grad-reduce")),
    Dimension("ddp_impl", ("local", "torch"), lambda v, c: ["--DDP-impl", v], weights=(5, 1)),
    Dimension("recompute", tuple(_RECOMPUTE), lambda v, c: _RECOMPUTE[v],
              weights=(3, 2, 1, 1, 1, 1, 0.3)),
    Dimension("distribute_saved_activations", (False, True),
              _switch("--distribute-saved-activations"), weights=(6, 1)),
    # A save at an iteration and a resume at another layout: None, or the iteration saved at;
    # the resume layout is drawn by draw_resume_layout. The torch format goes through
    # tools/checkpoint/convert.py to the resume layout; torch_dist loads there as saved.
    Dimension("resume_at", (None, 1, 2), lambda v, c: [], weights=(3, 1, 1), layout=False),
    Dimension("ckpt_format", ("torch", "torch_dist"),
              lambda v, c: ["--ckpt-format", v] if v != "torch" else [], layout=False),
)
BY_NAME = {d.name: d for d in DIMENSIONS}
LAYOUT = tuple(d.name for d in DIMENSIONS if d.layout)


def world_size(cfg: Config) -> int:
    """Ranks of a configuration's run: every dimension that splits the work over ranks."""
    return cfg["tp"] * cfg["pp"] * cfg["dp"] * cfg.get("cp", 1)


def global_batch_size(cfg: Config) -> int:
    """Kept by a resume at another layout (which draws its own micro-batch count from it)."""
    return cfg.get("global_batch_size") or \
        cfg["micro_batch_size"] * cfg["dp"] * cfg["microbatches"]


def baseline() -> Config:
    return {d.name: d.values[0] for d in DIMENSIONS}


def baseline_layout() -> Config:
    """The layout dimensions at their baselines (a resume layout to start from)."""
    return {name: BY_NAME[name].values[0] for name in LAYOUT}


def reference_of(cfg: Config) -> Config:
    """The one-process run the configuration must equal: every layout dimension (and compile)
    at its baseline, the same model, data and global batch."""
    ref = {**cfg, **{name: BY_NAME[name].values[0] for name in LAYOUT}, "resume_at": None,
           "ckpt_format": "torch"}
    ref["global_batch_size"] = global_batch_size(cfg)
    ref.pop("resume_layout", None)
    return ref


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------

def _common_flags(cfg: Config, data: dict[str, str]) -> list[str]:
    """Everything but the dimensions: fp32, dropout 0, a short warmed-up cosine schedule."""
    tp = cfg["tp"]
    lr = "5e-3" if cfg["family"] == "bert" else "1e-3"
    flags = [*HIDDEN, "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
             "--global-batch-size", str(global_batch_size(cfg)),
             "--train-iters", str(ITERS), "--lr", lr, "--min-lr", str(float(lr) / 10),
             "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--clip-grad", "1.0",
             "--weight-decay", "0.01", "--seed", "1234",
             "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
             # The padded vocabulary is the same at every TP size (a multiple of 128).
             "--make-vocab-size-divisible-by", str(max(128 // tp, 1)),
             "--use-cpu-initialization", "--num-workers", "0", "--eval-iters", "0",
             "--log-interval", "1", "--distributed-backend", "gloo"]
    if cfg["family"] == "bert":
        flags += ["--mock-data", "--vocab-size", str(BERT_VOCAB),
                  "--tokenizer-type", "NullTokenizer"]
    else:
        flags += ["--data-path", data["prefix"], "--split", "95,5,0",
                  "--data-cache-path", data["cache_dir"], "--tokenizer-type",
                  "GPT2BPETokenizer", "--vocab-file", data["vocab_file"],
                  "--merge-file", data["merge_file"]]
    return flags


def argv_of(cfg: Config, data: dict[str, str], extra: Sequence[str] = ()) -> list[str]:
    """pretrain_gpt.py / pretrain_bert.py flags of a configuration."""
    flags = _common_flags(cfg, data)
    for dim in DIMENSIONS:
        flags += dim.flags(cfg[dim.name], cfg)
    return flags + [str(a) for a in extra]


def resume_config(cfg: Config) -> Config:
    """The configuration of the resumed run: the model of ``cfg`` at its resume layout."""
    return {**cfg, **cfg["resume_layout"], "global_batch_size": global_batch_size(cfg),
            "resume_at": None, "resume_layout": None}


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def validation_error(cfg: Config, data: dict[str, str], save_dir: str,
                     load: bool = False) -> str | None:
    """Why the project's validation refuses the configuration (None: accepted).

    The checks pretrain() runs before any process group (``validate`` with the script's
    requirements) and, for BERT, pretrain_bert.py's own (``check_bert_flags``). With ``load``:
    as the resumed run, which loads ``save_dir``.
    """
    from megatron.config.cli import build_parser, parse_flags
    from megatron.config.validate import check_bert_flags, validate

    extra = ["--save", save_dir, "--save-interval", str(cfg["resume_at"])] \
        if cfg.get("resume_at") else []
    if load:
        extra += ["--load", save_dir]
    argv = argv_of(cfg, data, extra)
    try:
        flags = parse_flags(build_parser(), argv)
        if cfg["family"] == "bert":
            check_bert_flags(flags)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # --sequence-parallel at TP=1 is switched off
            validate(flags, world_size(cfg), require_model=True, require_train_length=True,
                     require_data=cfg["family"] != "bert")
    except ValueError as err:
        return str(err)
    return None


# Each refusal validation may give a draw, and why it is right. A refusal matching none of them
# is reported as unreviewed: either validation refuses something it should run, or this table
# lacks a reviewed entry.
EXPECTED_REFUSALS: tuple[tuple[str, str], ...] = (
    (r"is not divisible by --pipeline-model-parallel-size", "layers split evenly over stages"),
    (r"--num-attention-heads \(\d+\) is not divisible by --tensor-model-parallel-size",
     "attention heads split evenly over TP ranks"),
    (r"--num-query-groups \(\d+\) with --group-query-attention is not divisible",
     "each TP rank holds whole key/value groups"),
    (r"needs --pipeline-model-parallel-size >= 2", "the interleaved schedule needs stages"),
    (r"layers per stage is not divisible by\s+--num-layers-per-virtual-pipeline-stage",
     "virtual stages hold whole layers"),
    (r"the interleaved schedule .* to be divisible by --pipeline-model-parallel-size",
     "the interleaved 1F1B schedule runs micro-batches in groups of PP"),
    (r"--recompute-granularity full needs --recompute-method",
     "full recomputation needs a method"),
    (r"--distribute-saved-activations needs --tensor-model-parallel-size > 1",
     "the saved inputs are split over TP ranks under full recomputation"),
    (r"need --DDP-impl local with contiguous", "the distributed optimizer shards the local DDP "
     "buffer"),
    (r"with tied embeddings, --overlap-grad-reduce and --use-distributed-optimizer",
     "not built: the tied embedding's two stage gradients under overlapped sharded reduction"),
    (r"--untie-embeddings-and-output-weights: BERT's LM head is tied",
     "BERT's LM head is tied (as Megatron-LM)"),
    (r"--sequence-parallel splits the sequence", "the sequence splits evenly over TP ranks"),
    (r"--global-batch-size \(\d+\) is not divisible by --micro-batch-size",
     "a resume layout keeps the global batch, which must split into whole micro-batches per "
     "DP rank"),
    # Context parallelism
    (r"BERT \(bidirectional attention with a padding mask\) runs at context-parallel size 1",
     "not built: the blockwise attention applies no padding mask"),
    (r"--cp-comm-type a2a splits each TP rank's \d+ query heads",
     "Ulysses splits whole heads over CP ranks"),
    # Mixture of experts
    (r"--expert-model-parallel-size \d+ needs --num-experts",
     "expert parallelism splits experts, a dense model has none"),
    (r"world size \(\d+\) is not divisible by --expert-tensor-parallel-size",
     "the expert grid (ETP x EP x PP) tiles the world"),
    (r"--num-experts \(\d+\) is not divisible by --expert-model-parallel-size",
     "each EP rank holds whole experts"),
    (r"--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel",
     "each TP rank routes its own sequence-parallel rows"),
    (r"--expert-tensor-parallel-size \d+ with --expert-model-parallel-size \d+ needs "
     r"--DDP-impl local", "the expert gradients have their own local-DDP buffers"),
    (r"--expert-tensor-parallel-size \d+ with --expert-model-parallel-size \d+ and --save / "
     r"--load in --ckpt-format torch", "Megatron-LM's mp_rank_TT_PPP_EEE names hold the "
     "expert grid's files only when ETP <= TP <= ETP x EP"),
    (r"--ckpt-format torch_dist with BERT and --num-experts",
     "not built: BERT's MoE layers in the torch_dist key table"),
)


def classify_refusal(message: str) -> str | None:
    """The reviewed reason matching a refusal message, or None (unreviewed)."""
    for pattern, why in EXPECTED_REFUSALS:
        if re.search(pattern, message, flags=re.S):
            return why
    return None


# ---------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------

# A dimension whose value has no effect unless another is off its baseline: (it, the other).
_IDLE_UNLESS = (("cp_comm_type", "cp"), ("moe_topk", "num_experts"),
                ("moe_dispatcher", "num_experts"), ("etp", "num_experts"))


def without_idle_choices(cfg: Config) -> Config:
    """``cfg`` with the choices that change nothing (the CP exchange at CP=1, a router of a
    dense model) at their baselines: one configuration is not drawn under several names, and
    minimization does not spend runs on them."""
    out = dict(cfg)
    for name, parent in _IDLE_UNLESS:
        if out.get(parent) == BY_NAME[parent].values[0]:
            out[name] = BY_NAME[name].values[0]
    if out.get("etp") == out.get("tp"):
        out["etp"] = None  # the default expert split is TP's
    return out


def converter_limit(cfg: Config, layout: Config) -> str | None:
    """Why the resume cannot go through tools/checkpoint/convert.py (None: it can). The tool
    converts the torch format over TP / PP / virtual stages / EP / ETP / the distributed
    optimizer (torch_dist needs no conversion); the layouts the torch format cannot name are
    refused by validation, at the save and at the resume."""
    return None


@dataclasses.dataclass
class DrawLog:
    """What drawing saw: refusals by validation message, and configurations out of budget."""

    refusals: list[tuple[Config, str]] = dataclasses.field(default_factory=list)
    over_budget: int = 0


def draw_one(rng: random.Random, data: dict[str, str], save_dir: str, max_world: int,
             log: DrawLog, fixed: Config | None = None, tries: int = 500) -> Config:
    """A configuration validation accepts (``fixed`` values kept), redrawing refused ones."""
    for _ in range(tries):
        cfg = without_idle_choices({d.name: d.draw(rng) for d in DIMENSIONS})
        if cfg["resume_at"] is None:
            cfg["ckpt_format"] = "torch"  # a run that saves nothing has no format
        cfg.update(fixed or {})
        if world_size(cfg) > max_world:
            log.over_budget += 1
            continue
        error = validation_error(cfg, data, save_dir)
        if error is not None:
            log.refusals.append((cfg, error))
            continue
        if cfg["resume_at"] is not None:
            layout = draw_resume_layout(rng, cfg, data, save_dir, log)
            if layout is None:
                continue
            cfg["resume_layout"] = layout
        else:
            cfg["resume_layout"] = None
        return cfg
    raise RuntimeError(f"no valid configuration in {tries} draws (fixed: {fixed})")


def draw_resume_layout(rng: random.Random, cfg: Config, data: dict[str, str], save_dir: str,
                       log: DrawLog, tries: int = 200) -> Config | None:
    """Another layout of the same world size for the resumed run, validated."""
    for _ in range(tries):
        layout = {name: BY_NAME[name].draw(rng) for name in LAYOUT}
        candidate = without_idle_choices({**cfg, **layout,
                                          "global_batch_size": global_batch_size(cfg),
                                          "resume_at": None})
        layout = {name: candidate[name] for name in LAYOUT}
        if world_size(candidate) != world_size(cfg):
            continue
        if all(layout[n] == cfg[n] for n in ("tp", "pp", "dp", "cp", "ep", "etp",
                                             "layers_per_virtual_stage")):
            continue  # the same split: not "another layout"
        if converter_limit(cfg, layout) is not None:
            continue
        error = validation_error(candidate, data, save_dir, load=True)
        if error is not None:
            log.refusals.append((candidate, error))
            continue
        # The micro-batch count follows from the kept global batch.
        layout["microbatches"] = global_batch_size(cfg) // (cfg["micro_batch_size"] *
                                                            layout["dp"])
        return layout
    return None


def draw(seed: int, count: int, data: dict[str, str], save_dir: str, max_world: int = 8,
         log: DrawLog | None = None, fixed: Config | None = None) -> list[Config]:
    """``count`` accepted configurations from ``seed`` (the same list for the same seed),
    ``fixed`` values kept."""
    rng = random.Random(seed)
    log = log if log is not None else DrawLog()
    return [draw_one(rng, data, save_dir, max_world, log, fixed) for _ in range(count)]


def differences(cfg: Config) -> list[str]:
    """The dimensions of ``cfg`` not at their baseline (what minimization may drop)."""
    return [d.name for d in DIMENSIONS if cfg.get(d.name) != d.values[0]]
