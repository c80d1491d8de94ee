"""Helpers of the end-to-end training tests: argv of a tiny GPT, and pooled-world runners.

Every run goes through ``megatron.training.pretrain.pretrain`` with ``pretrain_gpt.py``'s own
providers and an explicit argv, on a pooled gloo world (``tests.multiprocess.run_distributed``);
several runs share one pooled call so the world (and the interpreter) is paid for once.

A run is a dict::

    {"argv": [...],               # pretrain_gpt.py flags
     "params": True,              # also return the full (TP-gathered) fp32 parameters
     "inf_at": ([iterations], rank, num_microbatches)  # that rank's training loss times inf
     "grad_inf_at": ([iterations], rank, num_microbatches)  # inf into the gradient of that
                                  # rank's stage output (a pipeline stage whose loss is finite)
     "single_process_init": True,  # start every stage from the one-process run's initial
                                  # weights (Megatron seeds stage p with seed + 100 p)
     "crash_save": (iteration, "shard" | "tracker"),    # die inside that save_checkpoint
     "bucket_size": elements}     # DDP bucket size (no flag sets it; default one 4M bucket)

and its result is ``{"history", "iteration", "params" (every rank's copy), "evals", "error"}``;
an exception of the expected kind (``expect_error``) is returned as text instead of raised.
``params`` hold every model chunk of the rank under the one-process names (layers renumbered
to their global index), so pipeline stages are compared by merging their ranks' dicts; ``evals``
the loss dict of every evaluation (empty on pipeline stages without the loss).

``history`` holds one dict per training iteration this rank ran (those before an expected error
too): the loss dict, "skipped", "grad norm", "learning rate" (after the step, as logged) and
"global batch size". The training loop keeps no such list (it would grow for the whole run only
for tests): :class:`_StepRecorder` takes the values from each ``train_step`` call of the run.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron.core import parallel_state

TINY_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A preprocessed GPT-2 dataset and its tokenizer files."""

    prefix: str
    vocab_file: str
    merge_file: str
    cache_dir: str


_SLICE_BYTES = 300_000


def build_gpt2_corpus(shared_data: Path, out: Path) -> Corpus:
    """~300 KB of tinyshakespeare under ``out``, tokenized by tools/preprocess_data.py with the
    real GPT-2 BPE files of ``shared_data`` (paragraph runs as documents, end-of-document tokens
    appended)."""
    from tools import preprocess_data

    tok = shared_data / "tokenizers"
    vocab, merges = tok / "gpt2-vocab.json", tok / "gpt2-merges.txt"
    text = (shared_data / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    paragraphs = text[:_SLICE_BYTES].split("\n\n")
    docs = ["\n\n".join(paragraphs[i:i + 8]) for i in range(0, len(paragraphs), 8)]
    src = out / "shakespeare.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    prefix = out / "shakespeare"
    rc = preprocess_data.main(["--input", str(src), "--output-prefix", str(prefix),
                               "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
                               "--merge-file", str(merges), "--append-eod", "--workers", "1"])
    assert rc == 0, f"preprocess_data exited {rc}"
    data_prefix = Path(f"{prefix}_text_document")
    assert data_prefix.with_suffix(".bin").is_file() and data_prefix.with_suffix(".idx").is_file()
    return Corpus(prefix=str(data_prefix), vocab_file=str(vocab), merge_file=str(merges),
                  cache_dir=str(out / "index-cache"))


def gpt_argv(corpus: Corpus, *, tp: int = 1, mbs: int = 2, gbs: int = 8, iters: int = 10,
             seq: int = 32, dropout: float = 0.0, lr: float = 1e-3,
             extra: Sequence[str] = ()) -> list[str]:
    """pretrain_gpt.py flags of a 2-layer, hidden-64 GPT on ``corpus`` (fp32 unless ``extra``
    says otherwise).

    The padded vocabulary is the same for every TP size (50304 = 128 x 393), so runs with
    different TP sizes build the same model: ``--make-vocab-size-divisible-by 128 / TP``.
    """
    argv = [*TINY_MODEL, "--tensor-model-parallel-size", str(tp),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs),
            "--train-iters", str(iters), "--lr", str(lr), "--min-lr", str(lr / 10),
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--clip-grad", "1.0",
            "--weight-decay", "0.01", "--seed", "1234",
            "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout),
            "--data-path", corpus.prefix, "--split", "95,5,0", "--data-cache-path",
            corpus.cache_dir, "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", corpus.vocab_file, "--merge-file", corpus.merge_file,
            "--make-vocab-size-divisible-by", str(128 // tp), "--use-cpu-initialization",
            "--num-workers", "0", "--eval-iters", "0", "--log-interval", "5",
            "--distributed-backend", "gloo"]
    return argv + [str(a) for a in extra]


def read_scalars(logdir) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every scalar in the TensorBoard event files under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        out[tag] = {}
        for event in acc.Scalars(tag):
            out[tag].setdefault(event.step, event.value)  # first value logged at that step
    return out


def losses(result: dict) -> list[float]:
    """The per-iteration 'lm loss' of a run's history."""
    return [h["lm loss"] for h in result["history"]]


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    assert len(a) == len(b), f"{len(a)} vs {len(b)} iterations"
    return max(abs(x - y) for x, y in zip(a, b))


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name].shape == b[name].shape, (name, a[name].shape, b[name].shape)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


# ---------------------------------------------------------------------------------------------
# Inside the ranks
# ---------------------------------------------------------------------------------------------

def _global_name(module: torch.nn.Module, name: str, ep_rank: int | None = None) -> str:
    """``name`` of a pipeline stage's parameter as the one-process model calls it: layers
    renumbered from their ``layer_number``, local experts from their expert-parallel rank
    (``ep_rank``, default this rank's: global = ep_rank * local + i); the last stage's
    tied-embedding copy is named ``word_embeddings.weight`` (the one-process model has none)."""
    parts = name.split(".")
    if "local_experts" in parts:
        at = parts.index("local_experts") + 1
        local = len(module.get_submodule(".".join(parts[:at])))
        if ep_rank is None:
            ep_rank = parallel_state.get_expert_model_parallel_rank()
        parts[at] = str(ep_rank * local + int(parts[at]))
    if "layers" in parts:
        at = parts.index("layers") + 1
        encoder = module.get_submodule(".".join(parts[:at]))
        parts[at] = str(encoder[int(parts[at])].layer_number - 1)
    return ".".join(parts)


def _gather_full_params(modules: torch.nn.Module | Sequence[torch.nn.Module]
                        ) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's model chunk(s) as the unsharded fp32 tensor (TP slices
    concatenated on their dim), under its one-process name."""
    from megatron.core import comm

    if isinstance(modules, torch.nn.Module):
        modules = [modules]
    tp_group = parallel_state.get_tensor_model_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    expert_grid = parallel_state.has_expert_grid()
    expert_tp_group = parallel_state.get_expert_tensor_parallel_group()
    out = {}
    for module in modules:
        for name, param in module.named_parameters():
            value = param.detach().float().clone()
            expert = expert_grid and not getattr(param, "allreduce", True)
            group = expert_tp_group if expert else tp_group  # the experts' split: ETP
            if comm.world_size(group) > 1 and getattr(param, "tensor_model_parallel", False):
                value = torch.cat(comm.all_gather_list(value.contiguous(), group),
                                  dim=param.partition_dim)
            if expert:
                # Every expert-parallel rank's experts, under their global indices.
                for r, v in enumerate(comm.all_gather_list(value.contiguous(), ep_group)):
                    out[_global_name(module, name, ep_rank=r)] = v
                continue
            out[_global_name(module, name)] = value
    return out


@torch.no_grad()
def _copy_single_process_init(module: torch.nn.Module, cfg) -> None:
    """Overwrite a stage's weights with the one-process run's initial ones: the whole model
    built from ``--seed`` as a world of one builds it (TP-invariant: this rank's TP slices)."""
    from megatron.config.core_configs import transformer_config
    from megatron.core import comm
    from megatron.core.models.gpt import GPTModel

    def built(tp_group) -> dict[str, torch.Tensor]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.model.seed)
            return dict(GPTModel(transformer_config(cfg), tp_group).named_parameters())

    tp_group = parallel_state.get_tensor_model_parallel_group()
    reference = built(tp_group)
    experts = reference  # the experts split over the expert TP group (ETP; TP off the grid)
    if parallel_state.has_expert_grid():
        expert_tp_group = parallel_state.get_expert_tensor_parallel_group()
        if comm.world_size(expert_tp_group) != comm.world_size(tp_group):
            experts = built(expert_tp_group if comm.world_size(expert_tp_group) > 1 else None)
    embedding = "language_model.embedding.word_embeddings.weight"
    for name, param in module.named_parameters():
        source = _global_name(module, name)
        table = experts if not getattr(param, "allreduce", True) else reference
        param.copy_(table[embedding if source == "word_embeddings.weight" else source])


class _InfInjector:
    """Wraps pretrain_gpt.forward_step: multiplies the training loss by inf on one rank at the
    given iterations (counted in training micro-batches; evaluation calls pass through)."""

    def __init__(self, forward_step, iterations: Sequence[int], rank: int,
                 num_microbatches: int) -> None:
        self.forward_step = forward_step
        self.iterations, self.rank = set(iterations), rank
        self.num_microbatches = num_microbatches
        self.calls = 0

    def __call__(self, data_iterator, model):
        output, loss_func = self.forward_step(data_iterator, model)
        if not torch.is_grad_enabled():
            return output, loss_func
        iteration = self.calls // self.num_microbatches + 1
        self.calls += 1
        if iteration not in self.iterations or torch.distributed.get_rank() != self.rank:
            return output, loss_func

        def poisoned(output_tensor):
            loss, reported = loss_func(output_tensor)
            return loss * math.inf, reported  # the logged loss stays finite: only grads blow up

        return output, poisoned


class _GradInfInjector(_InfInjector):
    """Multiplies the gradient reaching one rank's stage output by inf (the loss, and the
    stages after it, stay finite): the inf appears on that pipeline stage alone."""

    def __call__(self, data_iterator, model):
        output, loss_func = self.forward_step(data_iterator, model)
        if not torch.is_grad_enabled():
            return output, loss_func
        iteration = self.calls // self.num_microbatches + 1
        self.calls += 1
        if iteration in self.iterations and torch.distributed.get_rank() == self.rank:
            output.register_hook(lambda grad: grad * math.inf)
        return output, loss_func


class _StepRecorder:
    """Stands for ``megatron.training.loop.train_step`` during one run: calls it and appends the
    iteration's values to ``history`` (see the module docstring), computed as the loop computes
    the logged ones: the learning rate as ``Trainer._learning_rate``, the batch as the loop's
    ``batch``. An iteration whose step raises records nothing, as the loop logs nothing."""

    def __init__(self, train_step, history: list[dict[str, float]]) -> None:
        self.train_step = train_step
        self.signature = inspect.signature(train_step)
        self.history = history

    def __call__(self, *args, **kwargs):
        out = self.train_step(*args, **kwargs)
        losses_, skipped, grad_norm, _ = out
        call = self.signature.bind(*args, **kwargs).arguments
        optimizer, cfg, microbatches = call["optimizer"], call["cfg"], call["microbatches"]
        batch = microbatches.get() * cfg.training.micro_batch_size * cfg.data_parallel_size
        self.history.append({
            **losses_, "skipped": float(skipped),
            "grad norm": grad_norm if grad_norm is not None else float("nan"),
            "learning rate": optimizer.param_groups[0]["lr"] if optimizer.param_groups else 0.0,
            "global batch size": float(batch)})
        return out


class SimulatedCrash(RuntimeError):
    """Raised by the patched checkpoint writer to stand for a process dying mid-save."""


def _crashing_atomic_write(original, iteration: int, stage: str):
    """``checkpointing._atomic_write`` that dies while saving ``iteration``: half-way through
    the shard file (``stage="shard"``) or after every shard but before the tracker
    (``stage="tracker"``)."""
    from megatron.checkpointing import files as checkpointing

    iter_dir = f"iter_{iteration:07d}"

    def atomic_write(write, path):
        if stage == "shard" and path.name == checkpointing.MODEL_FILENAME \
                and path.parent.parent.name == iter_dir:
            def half_then_die(tmp):
                write(tmp)
                data = tmp.read_bytes()
                tmp.write_bytes(data[: len(data) // 2])
                raise SimulatedCrash(f"simulated crash while writing {path}")
            return original(half_then_die, path)
        if stage == "tracker" and path.name == checkpointing.TRACKER_FILENAME \
                and (path.parent / iter_dir).is_dir():
            raise SimulatedCrash(f"simulated crash before the tracker of iteration {iteration}")
        return original(write, path)

    return atomic_write


def _forget_compiled_code() -> None:
    """Start a run with TorchDynamo's caches empty, as a fresh process does. A pooled rank
    process serves many runs; the compiled variants of ``TransformerLayer.forward`` that earlier
    runs left would count towards Dynamo's recompile limit, and a rank that reaches it falls
    back to eager code (other collectives) while its peers still run their graphs. (Dynamo is
    not imported unless a run compiled something.)"""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
    # The MoE loss tracker is per process too: an earlier run's [num_layers] entries would
    # meet this run's other sizes in the pipeline all-reduce of a stage without MoE layers.
    from megatron.core.transformer.moe import metrics
    metrics.clear()


def _one_run(run: dict, expect_error: tuple[type, ...]) -> dict[str, Any]:
    import pretrain_gpt
    from megatron.core.distributed import DistributedDataParallel
    from megatron.checkpointing import files as checkpointing
    from megatron.training import loop
    from megatron.training.pretrain import pretrain

    _forget_compiled_code()
    built: list[torch.nn.Module] = []

    def model_provider(cfg, pre_process=True, post_process=True):
        module = pretrain_gpt.model_provider(cfg, pre_process, post_process)
        if run.get("single_process_init"):
            _copy_single_process_init(module, cfg)
        built.append(module)
        return module

    forward_step = pretrain_gpt.forward_step
    if run.get("inf_at") is not None:
        forward_step = _InfInjector(forward_step, *run["inf_at"])
    if run.get("grad_inf_at") is not None:
        forward_step = _GradInfInjector(forward_step, *run["grad_inf_at"])
    original = checkpointing._atomic_write
    if run.get("crash_save") is not None:
        checkpointing._atomic_write = _crashing_atomic_write(original, *run["crash_save"])
    ddp_defaults = DistributedDataParallel.__init__.__kwdefaults__
    saved_bucket_size = ddp_defaults["bucket_size"]
    if run.get("bucket_size") is not None:
        ddp_defaults["bucket_size"] = run["bucket_size"]
    result: dict[str, Any] = {"history": [], "iteration": None, "params": None, "evals": [],
                              "error": None}
    train_step, evaluate = loop.train_step, loop.evaluate
    loop.train_step = _StepRecorder(train_step, result["history"])

    def recording_evaluate(*args, **kwargs):
        losses_ = evaluate(*args, **kwargs)
        result["evals"].append(losses_)
        return losses_

    loop.evaluate = recording_evaluate
    start = time.perf_counter()
    try:
        state = pretrain(pretrain_gpt.datasets_provider, model_provider, forward_step,
                         argv=run["argv"])
        result["iteration"] = state.iteration
        result["seconds"] = time.perf_counter() - start
    except expect_error as err:
        result["error"] = f"{type(err).__name__}: {err}"
        return result
    finally:
        loop.train_step, loop.evaluate = train_step, evaluate
        checkpointing._atomic_write = original
        ddp_defaults["bucket_size"] = saved_bucket_size
    if run.get("params"):
        # Every rank's copy: replicas must agree too (a missed all-gather shows up here).
        result["params"] = _gather_full_params(_last_model(built))
    return result


def _last_model(built: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The chunks of the model pretrain() trained last (the provider's last calls)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return built[-(vpp or 1):]


def run_pretrains(rank: int, world_size: int, runs: list[dict],
                  expect_error: tuple[type, ...] = ()) -> list[dict[str, Any]]:
    """Run every ``run`` in order on this rank (module level: called by run_distributed)."""
    del rank, world_size
    out = []
    for run in runs:
        parallel_state.destroy_model_parallel()  # each run builds its own TP/DP groups
        out.append(_one_run(run, expect_error))
    return out


def pooled(world_size: int, runs: list[dict], expect_error: tuple[type, ...] = (),
           timeout: float = 300.0) -> list[list[dict[str, Any]]]:
    """``run_pretrains`` on a pooled world; returns ``[run][rank] -> result``."""
    from tests.multiprocess import run_distributed

    per_rank = run_distributed(world_size, run_pretrains, runs, expect_error, timeout=timeout)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(runs))]


__all__ = ["Corpus", "SimulatedCrash", "TINY_MODEL", "build_gpt2_corpus", "gpt_argv", "losses",
           "max_abs_diff", "max_param_diff", "pooled", "read_scalars", "run_pretrains"]
