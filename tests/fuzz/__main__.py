"""Command line of the layout fuzzer (docs/guide/fuzzing.md).

    python -m tests.fuzz --draws 20 --seed 7            # 20 random valid configurations
    python -m tests.fuzz --draws 200 --seed 7 --first-draw 120   # the same draws, from 120 on
    python -m tests.fuzz --config '{"family": ...}'     # replay one (as a failure prints it)
    python -m tests.fuzz --draws 20 --seed 7 --fix '{"num_experts": 4}'   # MoE models only

Exits 1 when a configuration fails (after printing its reproducer and minimized form), 0 when
every one equals one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=10, help="configurations to draw")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws")
    parser.add_argument("--first-draw", type=int, default=0,
                        help="check the draws from this index on (the same draws are made: a "
                             "long run continues where a stopped one ended)")
    parser.add_argument("--max-world", type=int, default=8,
                        help="largest world (gloo ranks on this machine) a draw may need")
    parser.add_argument("--config", default=None,
                        help="run this one configuration (JSON, as a failure prints it)")
    parser.add_argument("--fix", default=None, metavar="JSON",
                        help="dimensions every draw keeps, e.g. '{\"num_experts\": 4}' for "
                             "mixture-of-experts models only")
    parser.add_argument("--no-minimize", action="store_true",
                        help="report failures without minimizing them")
    parser.add_argument("--list", action="store_true",
                        help="only draw (and validate): print the configurations")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(),
                                                          f"megatron-fuzz-{os.getuid()}"),
                        help="corpus cache and checkpoints (default: %(default)s)")
    parser.add_argument("--shared-data", default=None,
                        help="the shared data directory (tokenizers, corpus); default: "
                             "$MEGATRON_SHARED_DATA or ../shared/data")
    return parser


def _corpus(workdir: Path, shared: Path) -> dict[str, str]:
    """The GPT-2-tokenized corpus slice of the end-to-end tests, built once under workdir."""
    import dataclasses

    from tests.training import e2e

    out = workdir / "corpus"
    prefix = out / "shakespeare_text_document"
    if prefix.with_suffix(".idx").is_file():
        tok = shared / "tokenizers"
        corpus = e2e.Corpus(prefix=str(prefix), vocab_file=str(tok / "gpt2-vocab.json"),
                            merge_file=str(tok / "gpt2-merges.txt"),
                            cache_dir=str(out / "index-cache"))
    else:
        out.mkdir(parents=True, exist_ok=True)
        corpus = e2e.build_gpt2_corpus(shared, out)
    return dataclasses.asdict(corpus)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MEGATRON_CHECK_COLLECTIVES", "1")  # as the test suite runs
    opts = _parser().parse_args(argv)
    from tests.conftest import SHARED_DATA
    from tests.fuzz import runner, space

    workdir = Path(opts.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = _corpus(workdir, Path(opts.shared_data) if opts.shared_data else SHARED_DATA)
    log = space.DrawLog()
    start = time.perf_counter()
    if opts.config is not None:
        configs = [json.loads(opts.config)]
        error = space.validation_error(configs[0], data, str(workdir / "validation"))
        if error is not None:
            print(f"validation refuses this configuration: {error}")
            return 2
    else:
        fixed = json.loads(opts.fix) if opts.fix else None
        unknown = sorted(set(fixed or {}) - set(space.BY_NAME))
        if unknown:
            print(f"--fix: no such dimension {unknown} (the dimensions: "
                  f"{', '.join(space.BY_NAME)})")
            return 2
        configs = space.draw(opts.seed, opts.draws, data, str(workdir / "validation"),
                             opts.max_world, log, fixed)
    print(f"{len(configs)} configurations ({len(log.refusals)} refused by validation, "
          f"{log.over_budget} over {opts.max_world} ranks, redrawn)")
    if opts.list:
        for i, cfg in enumerate(configs):
            print(f"[{i:3d}] world {space.world_size(cfg)}  {runner.describe(cfg)}")
        print("\n".join(runner.summarize_refusals(log)))
        return 0
    # One world at a time: the machine is shared (an idle world's ranks hold their memory).
    fuzzer = runner.Fuzzer(data, workdir / "runs", log=lambda line: print(line, flush=True),
                           one_world_at_a_time=True)
    failures = runner.fuzz(configs, fuzzer, minimize=not opts.no_minimize,
                           first_draw=opts.first_draw)
    print(f"\n{len(configs)} configurations, {len(failures)} failed, {fuzzer.runs} runs "
          f"({len(fuzzer.references)} one-process references), "
          f"{time.perf_counter() - start:.0f} s")
    if log.refusals:
        print("refused by validation (redrawn):")
        print("\n".join(runner.summarize_refusals(log)))
    for cfg, problems, minimized in failures:
        print()
        print(runner.report_failure(cfg, problems, minimized, data))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
