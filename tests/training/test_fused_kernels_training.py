"""Training with the fusions on (the default) equals training with every fusion off, at TP=1 and
TP=2, and training still runs, saying so once on rank 0, when the kernel extension cannot be
imported.

"Fused": the unfused attention path (``--attention-backend unfused``: the fused softmax serves
it) with every fusion on. "Unfused": the same with ``--no-masked-softmax-fusion
--no-bias-dropout-fusion --no-gradient-accumulation-fusion``, the extension made unimportable
(layer norm falls back to ``F.layer_norm``) and ``--openai-gelu`` (the tanh GeLU the fused
bias-gelu computes, through ``F.gelu``). fp32, dropout 0.1 (the same draws on both sides).
Tolerance: 2e-5 on the loss of every iteration (about 11), 2e-5 on every parameter (after 4
steps): the kernels sum in another order than PyTorch's ops, nothing else differs.

A Llama-style GPT (RMSNorm, SwiGLU, RoPE, GQA; TP=2 with sequence parallelism) trains the same
with the RMS-norm kernel as with the PyTorch RMSNorm (``rms_norm`` taken out of
``kernels.FASTER_THAN_PYTORCH`` for that run only, so nothing else differs), to 1e-5.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training import e2e
from tests.training.test_llama import LLAMA

ROOT = Path(__file__).resolve().parents[2]
EXTENSION = "megatron.fused_kernels._cpu"
FUSIONS_OFF = ["--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
               "--no-gradient-accumulation-fusion", "--openai-gelu"]
LOSS_TOL = PARAM_TOL = 2e-5
RMS_NORM_TOL = 1e-5


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_with_kernels(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """Each run through e2e's pretrain runner; runs marked ``block_kernels`` with the CPU
    extension unimportable (``sys.modules[name] = None`` makes ``import`` raise ImportError),
    runs marked ``pytorch_rms_norm`` with the RMS-norm kernel off. Every run's result gets the
    fused-kernel log lines of this rank and ``kernel_uses``: {kernel: times a kernel was
    chosen} (``kernels.preferred`` calls that returned an extension)."""
    from megatron.core.fusions import kernels

    out = []
    for run in runs:
        saved = sys.modules.get(EXTENSION)
        handler, logger = _Lines(), logging.getLogger("megatron")
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)  # the pooled worker may leave it at the root's WARNING
        if run.get("block_kernels"):
            sys.modules[EXTENSION] = None
        faster, preferred, uses = dict(kernels.FASTER_THAN_PYTORCH), kernels.preferred, {}
        if run.get("pytorch_rms_norm"):
            kernels.FASTER_THAN_PYTORCH["cpu"] = faster["cpu"] - {"rms_norm"}
        kernels.preferred = _counting(preferred, uses)
        kernels.reset()
        try:
            result = e2e.run_pretrains(rank, world_size, [run])[0]
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            kernels.FASTER_THAN_PYTORCH.update(faster)
            kernels.preferred = preferred
            if saved is None:
                sys.modules.pop(EXTENSION, None)
            else:
                sys.modules[EXTENSION] = saved
            kernels.reset()
        result["kernel_log"] = [line for line in handler.lines if "fused kernels" in line]
        result["kernel_uses"] = uses
        out.append(result)
    return out


def _counting(preferred, uses: dict[str, int]):
    def counted(kernel: str, device_type: str):
        ext = preferred(kernel, device_type)
        if ext is not None:
            uses[kernel] = uses.get(kernel, 0) + 1
        return ext
    return counted


def _argv(corpus, tp: int, fused: bool) -> list[str]:
    extra = ["--attention-backend", "unfused"] + ([] if fused else FUSIONS_OFF)
    return e2e.gpt_argv(corpus, tp=tp, iters=4, dropout=0.1, extra=extra)


def _llama_argv(corpus) -> list[str]:
    return e2e.gpt_argv(corpus, tp=2, iters=4, seq=16, mbs=1, gbs=4,
                        extra=[*LLAMA, "--sequence-parallel"])


@pytest.fixture(scope="module")
def per_rank(gpt2_corpus):
    """[rank][run]: the GPT runs fused and unfused at TP=1 and TP=2, then the Llama-style run
    with and without the RMS-norm kernel; one world for all of them."""
    from tests.multiprocess import run_distributed

    runs = [{"argv": _argv(gpt2_corpus, tp, fused), "params": True,
             "block_kernels": not fused}
            for tp in (1, 2) for fused in (True, False)]
    runs += [{"argv": _llama_argv(gpt2_corpus), "params": True, "pytorch_rms_norm": pytorch}
             for pytorch in (False, True)]
    return run_distributed(2, run_with_kernels, runs, timeout=600)


def test_fused_training_equals_unfused_tp1_and_tp2(per_rank):
    results = [per_rank[0][i] for i in range(4)]
    for tp, (fused, unfused) in zip((1, 2), (results[0:2], results[2:4])):
        assert len(fused["history"]) == 4, tp
        diff = e2e.max_abs_diff(e2e.losses(fused), e2e.losses(unfused))
        assert diff <= LOSS_TOL, f"TP={tp}: losses differ by {diff}"
        pdiff = e2e.max_param_diff(fused["params"], unfused["params"])
        assert pdiff <= PARAM_TOL, f"TP={tp}: parameters differ by {pdiff}"
        # The fallback ran (and said so, once, on rank 0 only); the fused run used the kernels.
        assert any("using megatron.fused_kernels._cpu" in ln for ln in fused["kernel_log"])
        notes = [ln for ln in unfused["kernel_log"] if "unavailable" in ln]
        assert len(notes) == 1 and EXTENSION in notes[0], unfused["kernel_log"]
        assert not per_rank[1][2 * (tp - 1) + 1]["kernel_log"]


def test_llama_rms_norm_kernel_equals_pytorch_path(per_rank):
    """Bits apart, not more: the kernel sums in another order than PyTorch's ops (the first
    run here: 2.4e-7 on the loss)."""
    kernel, pytorch = per_rank[0][4], per_rank[0][5]
    # Every forward's norms (two per layer and the final one, per micro-batch) ran the kernel;
    # the other run never did.
    assert kernel["kernel_uses"].get("rms_norm", 0) >= 5 * 4, kernel["kernel_uses"]
    assert "rms_norm" not in pytorch["kernel_uses"], pytorch["kernel_uses"]
    assert len(kernel["history"]) == 4 and not any(h["skipped"] for h in kernel["history"])
    diff = e2e.max_abs_diff(e2e.losses(kernel), e2e.losses(pytorch))
    assert diff <= RMS_NORM_TOL, (diff, e2e.losses(kernel), e2e.losses(pytorch))
    pdiff = e2e.max_param_diff(kernel["params"], pytorch["params"])
    assert pdiff <= RMS_NORM_TOL, pdiff


def test_pretrain_gpt_cli_with_extension_unimportable(gpt2_corpus, tmp_path):
    """The real script, extension blocked: trains, and the log names the fallback and why."""
    argv = e2e.gpt_argv(gpt2_corpus, iters=3,
                        extra=["--attention-backend", "unfused", "--log-interval", "1"])
    code = ("import runpy, sys; sys.modules[%r] = None; sys.argv = ['pretrain_gpt.py'] + %r; "
            "runpy.run_path('pretrain_gpt.py', run_name='__main__')" % (EXTENSION, argv))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    notes = [ln for ln in out.splitlines() if "fused kernels" in ln]
    assert len(notes) == 1 and "unavailable" in notes[0] and EXTENSION in notes[0], notes
    assert len([ln for ln in out.splitlines() if ln.startswith(" iteration ")]) == 3, out[-4000:]
