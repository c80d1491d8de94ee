"""Run a drawn configuration and compare it with one process; minimize a failure.

Each configuration runs through ``pretrain()`` with pretrain_gpt.py's or pretrain_bert.py's
providers on a pooled gloo world (``tests.multiprocess``, through the end-to-end helpers of
``tests/training``), every stage started from the one-process run's initial weights. The
one-process reference of a model/data/batch is run once and cached. A draw fails when

* a rank raises or hangs after validation accepted the flags (a crash is a finding);
* a loss of any iteration (lm, and sop for BERT) differs from the reference by > LOSS_TOL;
* a final parameter (TP-gathered, stages merged) differs from the reference by > PARAM_TOL;
* two ranks' copies of one parameter differ at all (replicas must agree), or the last stage's
  copy of a tied embedding drifts from the first stage's;
* with ``resume_at``: the checkpoint of that iteration, converted by tools/checkpoint/convert.py
  (optimizer state kept) to the resume layout and loaded there, does not continue the
  uninterrupted run (losses and final parameters, same tolerances).
"""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.fuzz import space
from tests.fuzz.space import Config

LOSS_TOL = 1e-5
PARAM_TOL = 2e-5
TIED_COPY_TOL = 1e-6
TIMEOUT_S = 420.0
STARTUP_RETRIES = 2
ROUND = 10  # draws per round of a run (see fuzz)
EMBEDDING = "language_model.embedding.word_embeddings.weight"
HEAD_COPY = "word_embeddings.weight"


# ---------------------------------------------------------------------------------------------
# Inside the ranks
# ---------------------------------------------------------------------------------------------

class _ScaledLoss:
    """A deliberate bug for the fuzzer's own test: one rank's training loss (so its gradient)
    is multiplied by ``scale``; the logged loss is left alone."""

    def __init__(self, forward_step, rank: int, scale: float) -> None:
        self.forward_step, self.rank, self.scale = forward_step, rank, scale

    def __call__(self, data_iterator, model):
        output, loss_func = self.forward_step(data_iterator, model)
        if torch.distributed.get_rank() != self.rank:
            return output, loss_func

        def scaled(output_tensor):
            loss, reported = loss_func(output_tensor)
            return loss * self.scale, reported

        return output, scaled


@contextlib.contextmanager
def _injected(module, fault: dict | None):
    original = module.forward_step
    if fault is not None:
        module.forward_step = _ScaledLoss(original, fault["rank"], fault["scale"])
    try:
        yield
    finally:
        module.forward_step = original


def _one_run(run: dict) -> dict[str, Any]:
    from megatron.core.distributed import DistributedDataParallel
    from tests.training import e2e

    if run["family"] != "bert":
        import pretrain_gpt

        with _injected(pretrain_gpt, run.get("inject")):
            return e2e._one_run(run, ())
    import pretrain_bert
    from tests.training.test_bert_pretrain import _one_bert_run

    defaults = DistributedDataParallel.__init__.__kwdefaults__
    saved = defaults["bucket_size"]
    if run.get("bucket_size") is not None:
        defaults["bucket_size"] = run["bucket_size"]
    try:
        with _injected(pretrain_bert, run.get("inject")):
            return _one_bert_run(run)
    finally:
        defaults["bucket_size"] = saved


def run_in_ranks(rank: int, world_size: int, runs: list[dict]) -> list[dict[str, Any]]:
    """Every run in order on this rank (module level: called by run_distributed)."""
    import logging

    from megatron.core import parallel_state
    from megatron.core.log import get_logger

    del rank, world_size
    logger = get_logger()
    level = logger.level
    if runs and runs[0].get("quiet"):
        logger.setLevel(logging.WARNING)  # the fuzzer prints one line per draw
    out = []
    try:
        for run in runs:
            parallel_state.destroy_model_parallel()  # each run builds its own groups
            out.append(_one_run(run))
    finally:
        logger.setLevel(level)
    return out


# ---------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------

def loss_keys(cfg: Config) -> tuple[str, ...]:
    return ("lm loss", "sop loss") if cfg["family"] == "bert" else ("lm loss",)


def _series(result: dict, key: str) -> list[float]:
    return [h[key] for h in result["history"]]


def _loss_ranks(ranks: list[dict]) -> list[dict]:
    """The ranks that hold the loss (the last pipeline stage's)."""
    return [r for r in ranks if r["history"] and "lm loss" in r["history"][0]]


def _canonical(params: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """The TP-gathered parameters in the one-process layout: SwiGLU's fc1 gathers as
    [gate_0; up_0; gate_1; up_1] (Megatron's per-rank [gate_r; up_r]), one process holds
    [gate; up]; the same for the shared expert's fc1 (split over TP) and every routed
    expert's (split over the expert tensor-parallel size)."""
    if cfg["family"] != "llama":
        return params
    expert_tp = cfg.get("etp") or cfg["tp"]
    out = dict(params)
    for name, value in params.items():
        parts = expert_tp if ".local_experts." in name else cfg["tp"]
        if parts > 1 and ".mlp." in name and (name.endswith("dense_h_to_4h.weight")
                                              or name.endswith("dense_h_to_4h.bias")):
            halves = [chunk.chunk(2) for chunk in value.chunk(parts)]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return out


def merged_params(ranks: list[dict], cfg: Config) -> tuple[dict[str, torch.Tensor], list[str]]:
    """One dict of the whole model from every rank; the replicas' disagreements."""
    merged: dict[str, torch.Tensor] = {}
    owner: dict[str, int] = {}
    problems = []
    for rank, result in enumerate(ranks):
        for name, value in result["params"].items():
            if name in merged:
                diff = float((merged[name] - value).abs().max())
                if diff != 0.0:
                    problems.append(f"replicas of {name} differ: rank {owner[name]} vs rank "
                                    f"{rank} by {diff:.3g}")
            else:
                merged[name], owner[name] = value, rank
    if HEAD_COPY in merged:
        diff = float((merged.pop(HEAD_COPY) - merged[EMBEDDING]).abs().max())
        if diff > TIED_COPY_TOL:
            problems.append(f"the last stage's copy of the tied embedding drifted by {diff:.3g}")
    return _canonical(merged, cfg), problems


def compare(reference: dict, ranks: list[dict], cfg: Config, first_iteration: int = 0,
            what: str = "run") -> list[str]:
    """What differs between a parallel run (every rank's result) and the reference, from
    ``first_iteration`` (0-based) of the reference's history on."""
    problems = []
    loss_ranks = _loss_ranks(ranks)
    if not loss_ranks:
        return [f"{what}: no rank reported a loss"]
    for result in loss_ranks:
        if any(h["skipped"] for h in result["history"]):
            problems.append(f"{what}: skipped iterations")
        for key in loss_keys(cfg):
            ref, got = _series(reference, key)[first_iteration:], _series(result, key)
            if len(ref) != len(got):
                problems.append(f"{what}: {len(got)} iterations of {key}, expected {len(ref)}")
                continue
            diff = max(abs(a - b) for a, b in zip(ref, got))
            if diff > LOSS_TOL:
                problems.append(f"{what}: {key} differs from one process by {diff:.3g}\n"
                                f"    one process {ref}\n    {what:<11} {got}")
    params, replica_problems = merged_params(ranks, cfg)
    problems += [f"{what}: {p}" for p in replica_problems]
    ref_params = reference["params"]
    if set(params) != set(ref_params):
        problems.append(f"{what}: parameter names differ: {sorted(set(params) ^ set(ref_params))}")
        return problems
    worst = max(((float((params[n] - ref_params[n]).abs().max()), n) for n in params),
                default=(0.0, ""))
    if worst[0] > PARAM_TOL:
        problems.append(f"{what}: final parameters differ from one process by {worst[0]:.3g} "
                        f"(worst: {worst[1]})")
    return problems


# ---------------------------------------------------------------------------------------------
# The driver (parent process)
# ---------------------------------------------------------------------------------------------

def _short_crash(message: str) -> str:
    """run_distributed's report with each traceback printed once: a rank that raised the same
    as an earlier one is named, not repeated."""
    blocks = message.split("\n--- ")
    seen: dict[str, str] = {}
    out = [blocks[0]]
    for block in blocks[1:]:
        head, _, body = block.partition("\n")
        if body and body in seen:
            out.append(f"{head} the same as {seen[body]}")
        else:
            seen.setdefault(body, head.split(" raised")[0])
            out.append(f"{head}\n{body}" if body else head)
    return "\n--- ".join(out)


def config_json(cfg: Config) -> str:
    return json.dumps(cfg, sort_keys=True, separators=(",", ":"))


def repro_command(cfg: Config) -> str:
    return f"python -m tests.fuzz --config {shlex.quote(config_json(cfg))}"


def describe(cfg: Config) -> str:
    """The non-baseline dimensions, short."""
    parts = [f"{name}={cfg[name]}" for name in space.differences(cfg)
             if name not in ("resume_at", "ckpt_format")]
    if cfg.get("resume_at"):
        layout = cfg["resume_layout"]
        parts.append(f"resume@{cfg['resume_at']}({cfg.get('ckpt_format', 'torch')})->"
                     f"tp{layout['tp']}pp{layout['pp']}dp{layout['dp']}"
                     + (f"cp{layout['cp']}" if layout.get("cp", 1) > 1 else "")
                     + (f"ep{layout['ep']}" if layout.get("ep", 1) > 1 else "")
                     + (f"etp{layout['etp']}" if layout.get("etp") is not None else "")
                     + (f"v{layout['layers_per_virtual_stage']}"
                        if layout["layers_per_virtual_stage"] else "")
                     + ("+distopt" if layout["distributed_optimizer"] else ""))
    return " ".join(parts) or "baseline"


class Fuzzer:
    """Runs configurations against cached one-process references.

    Args:
        data: the GPT corpus (``prefix``, ``vocab_file``, ``merge_file``, ``cache_dir``).
        workdir: a directory for checkpoints (each draw's own subdirectory, removed after).
        log: where progress lines go.
    """

    def __init__(self, data: dict[str, str], workdir: Path, log: Callable[[str], None] = print,
                 timeout: float = TIMEOUT_S, quiet: bool = True,
                 one_world_at_a_time: bool = False) -> None:
        self.data, self.workdir, self.log, self.timeout = data, Path(workdir), log, timeout
        self.quiet, self.one_world_at_a_time = quiet, one_world_at_a_time
        self.references: dict[str, dict] = {}
        self.runs = 0

    def _pooled(self, world: int, runs: list[dict]) -> list[list[dict]]:
        from tests.multiprocess import close_worlds, run_distributed

        if self.one_world_at_a_time:
            close_worlds(keep=world)
        self.runs += len(runs)
        for attempt in range(STARTUP_RETRIES + 1):
            try:
                per_rank = run_distributed(world, run_in_ranks, runs, timeout=self.timeout)
                break
            except RuntimeError as err:
                # A world that could not start (a loaded machine) is not a finding: retry.
                if not str(err).startswith("start-up failed") or attempt == STARTUP_RETRIES:
                    raise
                self.log(f"    a world of {world} failed to start; retrying")
        return [[per_rank[r][i] for r in range(world)] for i in range(len(runs))]

    def _run_spec(self, cfg: Config, extra=(), init: bool = True,
                  inject: dict | None = None) -> dict:
        return {"argv": space.argv_of(cfg, self.data, extra), "params": True,
                "single_process_init": init, "family": cfg["family"],
                # A small DDP bucket gives several buckets: overlap reduces bucket by bucket.
                "bucket_size": 20_000 if cfg.get("overlap_grad_reduce") else None,
                "inject": inject, "quiet": self.quiet}

    def reference(self, cfg: Config) -> dict:
        """The one-process run of ``cfg``'s model, data and batch (cached)."""
        ref_cfg = space.reference_of(cfg)
        key = config_json(ref_cfg)
        if key not in self.references:
            self.references[key] = self._pooled(1, [self._run_spec(ref_cfg, init=False)])[0][0]
        return self.references[key]

    def prefetch_references(self, configs: list[Config]) -> None:
        """Every missing reference of ``configs`` in one pooled call."""
        todo = {}
        for cfg in configs:
            ref_cfg = space.reference_of(cfg)
            key = config_json(ref_cfg)
            if key not in self.references:
                todo[key] = self._run_spec(ref_cfg, init=False)
        if not todo:
            return
        try:
            results = self._pooled(1, list(todo.values()))
        except RuntimeError:
            return  # one crashed: check() runs each alone and reports the one that crashes
        self.references.update({key: r[0] for key, r in zip(todo, results)})

    def check(self, cfg: Config, inject: dict | None = None) -> list[str]:
        """Problems of one configuration (empty: it equals one process)."""
        try:
            reference = self.reference(cfg)
        except RuntimeError as err:
            return [f"the one-process reference crashed:\n{_short_crash(str(err))}"]
        world = space.world_size(cfg)
        draw_dir = self.workdir / f"draw{self.runs}"
        shutil.rmtree(draw_dir, ignore_errors=True)
        draw_dir.mkdir(parents=True)
        try:
            return self._check(cfg, reference, world, draw_dir, inject)
        finally:
            shutil.rmtree(draw_dir, ignore_errors=True)

    def _check(self, cfg: Config, reference: dict, world: int, draw_dir: Path,
               inject: dict | None) -> list[str]:
        save = draw_dir / "save"
        resume_at = cfg.get("resume_at")
        extra = ["--save", str(save), "--save-interval", str(resume_at)] if resume_at else []
        try:
            straight = self._pooled(world, [self._run_spec(cfg, extra, inject=inject)])[0]
        except RuntimeError as err:
            return [f"crash after validation accepted the flags:\n{_short_crash(str(err))}"]
        problems = compare(reference, straight, cfg)
        if resume_at and not problems:
            problems += self._check_resume(cfg, reference, save, draw_dir, inject)
        return problems

    def _check_resume(self, cfg: Config, reference: dict, save: Path, draw_dir: Path,
                      inject: dict | None) -> list[str]:
        resumed_cfg = space.resume_config(cfg)
        if cfg["ckpt_format"] == "torch_dist":
            # Saved at one layout, loaded at another as it is: no conversion step.
            load = ["--load", str(save), "--ckpt-step", str(cfg["resume_at"])]
        else:
            load, problems = self._converted(cfg, save, draw_dir)
            if problems:
                return problems
        try:
            resumed = self._pooled(space.world_size(resumed_cfg), [self._run_spec(
                resumed_cfg, load, init=False, inject=inject)])[0]
        except RuntimeError as err:
            return [f"the resume at the {'converted ' if cfg['ckpt_format'] == 'torch' else ''}"
                    f"layout crashed:\n{_short_crash(str(err))}"]
        # The resumed run's own layout decides how its gathered parameters are laid out.
        return compare(reference, resumed, resumed_cfg, first_iteration=cfg["resume_at"],
                       what="resumed")

    @staticmethod
    def _converted(cfg: Config, save: Path, draw_dir: Path) -> tuple[list[str], list[str]]:
        """tools/checkpoint/convert.py of the saved iteration to the resume layout: the
        resumed run's --load flags, or the problems."""
        from tools.checkpoint import convert

        layout, target = cfg["resume_layout"], draw_dir / "converted"
        argv = ["--model-type", "BERT" if cfg["family"] == "bert" else "GPT",
                "--load-dir", str(save / f"iter_{cfg['resume_at']:07d}"),
                "--save-dir", str(target), "--keep-optimizer-state",
                "--target-tensor-parallel-size", str(layout["tp"]),
                "--target-pipeline-parallel-size", str(layout["pp"]),
                "--target-expert-parallel-size", str(layout.get("ep", 1)),
                "--target-use-distributed-optimizer" if layout["distributed_optimizer"]
                else "--no-target-use-distributed-optimizer"]
        if layout.get("etp") is not None:
            argv += ["--target-expert-tensor-parallel-size", str(layout["etp"])]
        if layout["layers_per_virtual_stage"] is not None:
            argv += ["--target-num-layers-per-virtual-pipeline-stage",
                     str(layout["layers_per_virtual_stage"])]
        rc = convert.main(argv)
        if rc != 0:
            return [], [f"tools/checkpoint/convert.py {shlex.join(argv)} exited {rc}"]
        return ["--load", str(target)], []

    # -----------------------------------------------------------------------------------------
    def minimize(self, cfg: Config, inject: dict | None = None) -> Config:
        """Drop one feature at a time (back to its baseline) while the configuration still
        fails and validation accepts it; the smallest failing configuration."""
        current = dict(cfg)
        changed = True
        while changed:
            changed = False
            for name in space.differences(current):
                candidate = self._dropped(current, name)
                if candidate is None:
                    continue
                if self._refused(candidate):
                    continue
                if self.check(candidate, inject):
                    self.log(f"    still fails without {name}")
                    current, changed = candidate, True
                    break
        return current

    def _refused(self, cfg: Config) -> bool:
        """Validation refuses the configuration or its resume layout."""
        save_dir = str(self.workdir / "validation")
        if space.validation_error(cfg, self.data, save_dir):
            return True
        return bool(cfg.get("resume_at")) and space.validation_error(
            space.resume_config(cfg), self.data, save_dir, load=True) is not None

    @staticmethod
    def _dropped(cfg: Config, name: str) -> Config | None:
        """``cfg`` with ``name`` at its baseline; None where the resume layout would no longer
        match the world size."""
        candidate = {**cfg, name: space.BY_NAME[name].values[0]}
        if name == "resume_at":
            candidate["resume_layout"] = None
        elif candidate.get("resume_at") and \
                space.world_size(candidate) != space.world_size(cfg):
            return None
        if candidate.get("resume_at") and cfg.get("resume_layout"):
            gbs = space.global_batch_size(candidate)
            if gbs % (candidate["micro_batch_size"] * candidate["resume_layout"]["dp"]):
                return None
            candidate["resume_layout"] = {
                **cfg["resume_layout"],
                "microbatches": gbs // (candidate["micro_batch_size"] *
                                        cfg["resume_layout"]["dp"])}
        return candidate


def report_failure(cfg: Config, problems: list[str], minimized: Config | None,
                   data: dict[str, str]) -> str:
    """A failure's report: the problems, the command that reproduces it, the minimized
    configuration and its pretrain flags."""
    lines = ["FAILED " + describe(cfg), *("  " + p for p in problems),
             f"  reproduce: {repro_command(cfg)}"]
    if minimized is not None:
        lines += [f"  minimized: {describe(minimized)}",
                  f"  reproduce the minimized one: {repro_command(minimized)}",
                  f"  its flags (world of {space.world_size(minimized)}, every stage starting "
                  f"from the one-process weights): "
                  f"{shlex.join(space.argv_of(minimized, data))}"]
    return "\n".join(lines)


def summarize_refusals(log: space.DrawLog) -> list[str]:
    """Refusal counts by reviewed reason; unreviewed refusals each with an example."""
    counts: dict[str, int] = {}
    unreviewed: dict[str, Config] = {}
    for cfg, message in log.refusals:
        why = space.classify_refusal(message)
        if why is None:
            unreviewed.setdefault(message, cfg)
        else:
            counts[why] = counts.get(why, 0) + 1
    lines = [f"  {n:4d}  {why}" for why, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    for message, cfg in unreviewed.items():
        lines.append(f"  UNREVIEWED refusal: {message}\n      e.g. {config_json(cfg)}")
    return lines


def fuzz(configs: list[Config], fuzzer: Fuzzer, minimize: bool = True,
         inject: dict | None = None, round_size: int = ROUND, first_draw: int = 0
         ) -> list[tuple[Config, list[str], Config | None]]:
    """Check every configuration from draw ``first_draw`` on, in rounds of ``round_size`` draws
    (references first, then by world size: each pooled world is started once a round, and a
    long run stopped early has checked every world size drawn, not only the smallest); the
    failures with their minimized configurations."""
    failures = []
    for first in range(first_draw, len(configs), round_size):
        failures += _fuzz_round(configs, range(first, min(first + round_size, len(configs))),
                                fuzzer, minimize, inject)
    return failures


def _fuzz_round(configs: list[Config], indices: range, fuzzer: Fuzzer, minimize: bool,
                inject: dict | None) -> list[tuple[Config, list[str], Config | None]]:
    fuzzer.prefetch_references([configs[i] for i in indices])
    failures = []
    order = sorted(indices, key=lambda i: space.world_size(configs[i]))
    for i in order:
        cfg = configs[i]
        start = time.perf_counter()
        problems = fuzzer.check(cfg, inject)
        status = "FAIL" if problems else "ok"
        fuzzer.log(f"[{i:3d}] world {space.world_size(cfg)} {status} "
                   f"{time.perf_counter() - start:5.1f}s  {describe(cfg)}")
        if problems:
            minimized = fuzzer.minimize(cfg, inject) if minimize else None
            failures.append((cfg, problems, minimized))
            fuzzer.log(report_failure(cfg, problems, minimized, fuzzer.data))
    return failures
