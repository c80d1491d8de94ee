"""One command that checks the project on a GPU machine: kernels, every entry point, speed.

    python bench/gpu_check.py [--out DIR] [--only STAGE,...] [--skip STAGE,...] [--jobs 4]
        [--wheels DIR] [--list]

Made for a fresh GPU machine with a bare checkout (no ``../shared``): everything it needs is
generated under ``--out`` (default ``gpu_check_out/``): a corpus from text already on the
machine (``tools/make_local_corpus.py``), a byte-level BPE and a WordPiece vocabulary trained on
it, the preprocessed ``.bin/.idx``, MNLI and zero-shot files in the official formats. Python
packages the machine lacks (flask for the server) install from wheels in ``--wheels`` (default
``.whl/`` when it exists) into a private folder; a stage whose package is still missing is
skipped with the reason.

The extensions build in the background (``setup.py build_ext``, into a private folder, then
moved into the tree atomically) while the GPU runs the entry points; the kernel and speed stages
wait for them. Functional stages run ``--jobs`` at a time (small models: the GPU has room); the
kernel and speed stages run alone, last. Each stage has its own timeout and writes its log to
``OUT/logs/STAGE.log`` as it runs; ``OUT/gpu_check.md`` (the table) and ``OUT/gpu_check.jsonl``
are rewritten after every stage, and the table is printed last: stage, rc, seconds, key figure.

On a machine without CUDA every stage runs on the CPU as a smoke test (tiny speed shapes), except
the ones that need a GPU, which are skipped with the reason.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@dataclasses.dataclass
class Result:
    stage: str
    rc: int | None  # None: skipped
    seconds: float
    figure: str

    def row(self) -> str:
        rc = "skip" if self.rc is None else str(self.rc)
        return f"| {self.stage} | {rc} | {self.seconds:.1f} | {self.figure} |"


@dataclasses.dataclass
class Stage:
    name: str
    run: Callable[["Check"], tuple[int | None, str]]
    deps: tuple[str, ...] = ()
    timeout: float = 150.0
    exclusive: bool = False  # timing stages: run alone, after the functional ones
    needs_gpu: bool = False


class StageFailed(Exception):
    pass


class Check:
    """Paths, environment and the shell helpers the stages use."""

    def __init__(self, out: str, wheels: str | None, gpu: bool) -> None:
        self.out, self.gpu = os.path.abspath(out), gpu
        self.logs = os.path.join(self.out, "logs")
        self.data = os.path.join(self.out, "data")
        self.ck = os.path.join(self.out, "checkpoints")
        for path in (self.logs, self.data, self.ck):
            os.makedirs(path, exist_ok=True)
        # Functional stages check every collective against NCCL's rules (megatron/core/comm.py);
        # the speed stages run as users do, without the checks.
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="2",
                        MEGATRON_CHECK_COLLECTIVES="1",
                        PYTHONPATH=os.pathsep.join(
                            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        self.site = self._install_wheels(wheels)
        self.build_done = threading.Event()
        self.build_error: str | None = None
        self.deadline: dict[str, float] = {}

    # Environment --------------------------------------------------------------------------
    def _install_wheels(self, wheels: str | None) -> str | None:
        if not wheels or not glob.glob(os.path.join(wheels, "*.whl")):
            return None
        site = os.path.join(tempfile.gettempdir(), "gpu_check_site")
        proc = subprocess.run(
            [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
             "--no-cache-dir", "--upgrade", "--target", site,
             *sorted(glob.glob(os.path.join(wheels, "*.whl")))],
            capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"wheels from {wheels} did not install: {proc.stderr[-500:]}")
            return None
        self.env["PYTHONPATH"] += os.pathsep + site  # after ours: the machine's own win ties
        return site

    def installed(self, module: str) -> bool:
        """Whether ``module`` can be found, here or among the wheels, without importing it
        (transformers takes seconds to import)."""
        if importlib.util.find_spec(module) is not None:
            return True
        return self.site is not None and os.path.isdir(os.path.join(self.site, module))

    def importable(self, module: str) -> bool:
        return subprocess.run([PY, "-c", f"import {module}"], env=self.env,
                              capture_output=True).returncode == 0

    # Running ------------------------------------------------------------------------------
    def sh(self, stage: str, cmd: list[str], timeout: float | None = None,
           env: dict | None = None) -> str:
        """Run ``cmd`` (cwd the repo), appending its output to the stage's log; returns the
        output; raises StageFailed on a non-zero exit or the stage's deadline."""
        left = self.deadline.get(stage, time.time() + 600) - time.time()
        timeout = min(timeout or left, left)
        log = os.path.join(self.logs, f"{stage}.log")
        with open(log, "a") as f:
            f.write(f"\n$ {' '.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            try:
                output, _ = proc.communicate(timeout=max(timeout, 1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
                f.write(output + "\n[timed out]\n")
                raise StageFailed(f"timed out after {timeout:.0f} s")
            f.write(output)
        if proc.returncode != 0:
            tail = [ln for ln in output.strip().splitlines() if ln.strip()][-1:] or [""]
            raise StageFailed(f"rc {proc.returncode}: {tail[0][:150]}")
        return output

    def torchrun(self, nproc: int) -> list[str]:
        return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(nproc)]

    def gpt_flags(self) -> list[str]:
        # Without a GPU (the smoke run) a smaller model: half precision is emulated on most CPUs.
        layers, hidden, mbs = ("4", "256", "8") if self.gpu else ("2", "128", "2")
        return ["--num-layers", layers, "--hidden-size", hidden, "--num-attention-heads", "8",
                "--seq-length", "256", "--max-position-embeddings", "256",
                "--micro-batch-size", mbs, "--global-batch-size", str(2 * int(mbs)),
                "--lr", "1e-3",
                "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
                "--weight-decay", "0.1", "--clip-grad", "1.0", "--hidden-dropout", "0",
                "--attention-dropout", "0", "--seed", "1234",
                "--data-path", os.path.join(self.data, "corpus_text_document"),
                "--split", "90,5,5", *self.gpt_tokenizer(), "--log-interval", "1",
                "--eval-interval", "10", "--eval-iters", "2", "--num-workers", "1"]

    def gpt_tokenizer(self) -> list[str]:
        tok = os.path.join(self.data, "tokenizer")
        return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                os.path.join(tok, "vocab.json"), "--merge-file", os.path.join(tok, "merges.txt")]

    def wait_for_build(self, stage: str) -> None:
        left = self.deadline[stage] - time.time()
        if not self.build_done.wait(timeout=max(left - 5, 1)):
            raise StageFailed("the extension build did not finish in time")
        if self.build_error:
            raise StageFailed(f"extension build failed: {self.build_error}")


# Parsing -------------------------------------------------------------------------------------
_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+\-naninf]+)")
_VALID = re.compile(r"validation loss at .*?lm loss value: ([0-9.E+\-]+)")


def lm_losses(text: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in _ITER.finditer(text)}


def last_valid_loss(text: str) -> float:
    found = _VALID.findall(text)
    if not found:
        raise StageFailed("no validation loss line")
    return float(found[-1])


def losses_figure(losses: dict[int, float]) -> str:
    if not losses:
        raise StageFailed("no iteration lines with an lm loss")
    first, last = min(losses), max(losses)
    return f"lm loss it{first} {losses[first]:.3f} -> it{last} {losses[last]:.3f}"


# Stages ------------------------------------------------------------------------------------
def stage_env(c: Check):
    out = c.sh("env", [PY, "-c", (
        "import torch, sys; print('python', sys.version.split()[0]); "
        "print('torch', torch.__version__, 'cuda', torch.version.cuda); "
        "print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')")])
    nvcc = shutil.which("nvcc")
    if nvcc:
        out += c.sh("env", [nvcc, "--version"]).strip().splitlines()[-1]
    device = re.search(r"device (.*)", out).group(1)
    torch_v = re.search(r"torch (\S+)", out).group(1)
    return 0, f"{device}; torch {torch_v}; nvcc {'yes' if nvcc else 'no'}"


def stage_data(c: Check):
    d = c.data
    corpus = os.path.join(d, "corpus.jsonl")
    if not os.path.exists(corpus):
        c.sh("data", [PY, "tools/make_local_corpus.py", "--output", corpus, "--max-mb", "3"])
    tok = os.path.join(d, "tokenizer")
    if not os.path.exists(os.path.join(tok, "vocab.json")):
        c.sh("data", [PY, "tools/train_tokenizer.py", "--input", corpus, "--type", "bpe",
                      "--vocab-size", "4096", "--output-dir", tok])
    if not os.path.exists(os.path.join(d, "corpus_text_document.idx")):
        c.sh("data", [PY, "tools/preprocess_data.py", "--input", corpus, "--output-prefix",
                      os.path.join(d, "corpus"), *c.gpt_tokenizer(), "--append-eod",
                      "--workers", "4"])
    # A WordPiece vocabulary (BERT tasks), plain text for the zero-shot files, MNLI files.
    c.sh("data", [PY, "-c", (
        "import json, os, sys, tokenizers\n"
        "d = sys.argv[1]\n"
        "texts = [json.loads(l)['text'] for l in open(os.path.join(d, 'corpus.jsonl'))]\n"
        "os.makedirs(os.path.join(d, 'text'), exist_ok=True)\n"
        "open(os.path.join(d, 'text', 'corpus.txt'), 'w').write('\\n\\n'.join(texts))\n"
        "wp = tokenizers.BertWordPieceTokenizer(lowercase=True)\n"
        "wp.train_from_iterator(texts, vocab_size=4096)\n"
        "wp.save_model(d)\n"), d])
    c.sh("data", [PY, "tasks/zeroshot_gpt/sample_data.py", "--text-dir",
                  os.path.join(d, "text"), "--output-dir", os.path.join(d, "zeroshot"),
                  "--lambada-max-words", "30"])  # within the check's --seq-length 256
    c.sh("data", [PY, "-m", "tasks.finetune_sample_data", "--task", "MNLI", "--out", d])
    size = os.path.getsize(os.path.join(d, "corpus_text_document.bin"))
    return 0, f"corpus {size / 2**20:.1f} MiB of tokens, vocab 4096 (BPE and WordPiece)"


def stage_build(c: Check):
    """Build the extensions into a private folder, then move each into the tree atomically
    (a stage importing one meanwhile sees the old file or none, never half a file)."""
    build_lib = os.path.join(c.out, "build_lib")
    try:
        c.sh("build", [PY, "setup.py", "-q", "build_ext", "--build-lib", build_lib,
                       "--build-temp", os.path.join(c.out, "build_tmp")])
        built = []
        for path in glob.glob(os.path.join(build_lib, "megatron", "**", "*.so"), recursive=True):
            target = os.path.join(ROOT, os.path.relpath(path, build_lib))
            shutil.copy2(path, target + ".tmp")
            os.replace(target + ".tmp", target)
            built.append(os.path.basename(path).split(".")[0])
    except StageFailed as exc:
        c.build_error = str(exc)
        raise
    finally:
        c.build_done.set()
    return 0, "built: " + ", ".join(sorted(built))


def train(c: Check, stage: str, extra: list[str], nproc: int = 1, env=None) -> str:
    return c.sh(stage, [*c.torchrun(nproc), "pretrain_gpt.py", *c.gpt_flags(), *extra], env=env)


def stage_gpt_bf16(c: Check):
    out = train(c, "gpt-bf16", ["--bf16", "--train-iters", "20", "--save",
                                os.path.join(c.ck, "gpt"), "--save-interval", "10"])
    return 0, losses_figure(lm_losses(out))


def stage_gpt_fp16(c: Check):
    # Megatron's initial loss scale (2^32) halves once per overflowing step: ten steps would
    # all be skipped (no lm loss logged), as in Megatron-LM; start where a user of 10 would.
    out = train(c, "gpt-fp16", ["--fp16", "--initial-loss-scale", "65536", "--train-iters", "10"])
    return 0, losses_figure(lm_losses(out))


# A Llama-shaped GPT (as examples/pretrain_llama.sh): RoPE, RMSNorm, SwiGLU, GQA, no biases.
LLAMA_FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
               "--ffn-hidden-size", "512", "--group-query-attention", "--num-query-groups", "2",
               "--disable-bias-linear", "--untie-embeddings-and-output-weights"]


def stage_llama(c: Check):
    out = train(c, "llama", ["--bf16", "--train-iters", "10", *LLAMA_FLAGS])
    return 0, losses_figure(lm_losses(out))


# A Mixtral-shaped MoE GPT (as examples/pretrain_mixtral.sh): 8 experts, top-2, fp32 router,
# grouped GEMM (torch._grouped_mm in bf16 on CUDA), aux and z losses in the log line.
MOE_FLAGS = [*LLAMA_FLAGS, "--num-experts", "8", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "256", "--moe-aux-loss-coeff", "1e-2",
             "--moe-z-loss-coeff", "1e-3", "--moe-router-dtype", "fp32", "--moe-grouped-gemm",
             "--moe-token-dispatcher-type", "alltoall"]


def stage_moe(c: Check):
    out = train(c, "moe", ["--bf16", "--train-iters", "10", *MOE_FLAGS])
    if "load_balancing_loss" not in out:
        raise StageFailed("moe: no load_balancing_loss in the log line")
    return 0, losses_figure(lm_losses(out))


def stage_gpt_distopt(c: Check):
    out = train(c, "gpt-distopt", ["--bf16", "--use-distributed-optimizer", "--train-iters",
                                   "10", "--save", os.path.join(c.ck, "distopt"),
                                   "--save-interval", "10"])
    return 0, losses_figure(lm_losses(out))


def stage_resume(c: Check):
    """The save at 10 resumed to 20 gives the uninterrupted run's losses."""
    src, dst = os.path.join(c.ck, "gpt"), os.path.join(c.ck, "gpt_resume")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("iter_0000020"))
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("10")
    resumed = lm_losses(train(c, "resume", ["--bf16", "--train-iters", "20", "--load", dst,
                                            "--save", dst, "--save-interval", "100"]))
    with open(os.path.join(c.logs, "gpt-bf16.log")) as f:
        reference = lm_losses(f.read())
    common = sorted(set(resumed) & set(reference))
    if not common or min(common) != 11:
        raise StageFailed(f"resumed iterations {sorted(resumed)}")
    worst = max(abs(resumed[i] - reference[i]) for i in common)
    if worst > 1e-4:
        raise StageFailed(f"resumed losses differ by {worst:.2e}")
    return 0, f"iterations 11-20 equal to the uninterrupted run (max diff {worst:.1e})"


# bf16 training of the same model with and without compiled layers drifts apart by rounding
# only; a wrong compiled layer (a lost gradient, a mask applied twice) moves the loss by more.
COMPILED_LOSS_TOL = 0.05


def stage_gpt_compiled(c: Check):
    """--compile-layers: gpt-bf16's first 10 iterations (same schedule) with every layer
    compiled (its first iteration and evaluation compile), the losses against gpt-bf16's."""
    compiled = lm_losses(train(c, "gpt-compiled", ["--bf16", "--train-iters", "20",
                                                   "--exit-interval", "10",
                                                   "--compile-layers"]))
    with open(os.path.join(c.logs, "gpt-bf16.log")) as f:
        reference = lm_losses(f.read())
    common = sorted(set(compiled) & set(reference))
    if len(common) < 10:
        raise StageFailed(f"compiled iterations {sorted(compiled)}")
    worst = max(abs(compiled[i] - reference[i]) for i in common)
    if worst > COMPILED_LOSS_TOL:
        raise StageFailed(f"compiled layers' losses differ from gpt-bf16's by {worst:.2e}")
    return 0, f"{losses_figure(compiled)}; max diff to gpt-bf16 {worst:.1e} (bf16)"


def evaluate(c: Check, stage: str, env=None) -> float:
    out = train(c, stage, ["--bf16", "--train-iters", "20", "--load", os.path.join(c.ck, "gpt"),
                           "--skip-train", "--distributed-backend",
                           "nccl" if env is None and c.gpu else "gloo"], env=env)
    return last_valid_loss(out)


def stage_eval_gpu(c: Check):
    return 0, f"validation lm loss {evaluate(c, 'eval-gpu'):.5f}"


def stage_eval_cpu(c: Check):
    """The GPU's checkpoint, evaluated on the CPU, gives the GPU's validation loss."""
    cpu = evaluate(c, "eval-cpu", env=dict(c.env, CUDA_VISIBLE_DEVICES=""))
    with open(os.path.join(c.logs, "eval-gpu.log")) as f:
        gpu = last_valid_loss(f.read())
    if abs(cpu - gpu) > 2e-2:  # bf16 on two devices: rounding differs, the value must not
        raise StageFailed(f"CPU {cpu:.5f} vs GPU {gpu:.5f}")
    return 0, f"CPU {cpu:.5f} vs GPU {gpu:.5f}"


def stage_convert(c: Check):
    dst = os.path.join(c.ck, "gpt_tp2")
    shutil.rmtree(dst, ignore_errors=True)
    # No GPU needed to convert: run it with none visible, on the GPU machine too.
    c.sh("convert", [PY, "tools/checkpoint/convert.py", "--model-type", "GPT",
                     "--loader", "megatron", "--saver", "megatron",
                     "--load-dir", os.path.join(c.ck, "gpt"), "--save-dir", dst,
                     "--target-tensor-parallel-size", "2"],
         env=dict(c.env, CUDA_VISIBLE_DEVICES=""))
    return 0, "GPT TP1 -> TP2, no GPU visible"


def generate(c: Check, stage: str, load: str, nproc: int, extra: list[str]) -> str:
    out = c.sh(stage, [*c.torchrun(nproc), "tools/generate.py", "--load", load,
                       "--use-checkpoint-args", *c.gpt_tokenizer(), "--micro-batch-size", "1",
                       "--prompt", "The history of the", "--prompt", "It is",
                       "--num-tokens-to-generate", "24", "--greedy", *extra])
    return out


def generated_text(out: str) -> list[str]:
    """The lines from the first ``--- prompt:`` header on (generate.py's answer)."""
    start = out.find("--- prompt:")
    return out[start:].strip().splitlines() if start >= 0 else []


def stage_generate(c: Check):
    load = os.path.join(c.ck, "gpt")
    cached = generated_text(generate(c, "generate", load, 1, []))
    recomputed = generated_text(generate(c, "generate", load, 1, ["--no-kv-cache"]))
    if cached != recomputed or not cached:
        raise StageFailed("KV-cache and --no-kv-cache greedy outputs differ")
    return 0, f"KV cache == --no-kv-cache ({len(cached)} lines, greedy)"


def stage_generate_tp2(c: Check):
    """The converted TP=2 checkpoint on two processes sharing the one GPU (gloo)."""
    tp2 = generated_text(generate(c, "generate-tp2", os.path.join(c.ck, "gpt_tp2"), 2,
                                  ["--distributed-backend", "gloo"]))
    with open(os.path.join(c.logs, "generate.log")) as f:
        tp1 = generated_text(f.read().split("\n$ ")[1])
    same = tp2 == tp1
    return 0, f"TP=2 greedy text {'==' if same else '!='} TP=1's (bf16)"


def stage_server(c: Check):
    if not c.importable("flask"):
        return None, "skipped: flask not installed (put its wheels in --wheels)"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(os.path.join(c.logs, "server.log"), "w")
    proc = subprocess.Popen(
        [*c.torchrun(1), "tools/run_text_generation_server.py", "--load",
         os.path.join(c.ck, "gpt"), "--use-checkpoint-args", *c.gpt_tokenizer(),
         "--micro-batch-size", "1", "--port", str(port)],
        cwd=ROOT, env=c.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        body = json.dumps({"prompts": ["The history of the"], "tokens_to_generate": 16,
                           "top_k": 1}).encode()
        deadline = c.deadline["server"] - 10
        while True:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/api", data=body,
                                             method="PUT",
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as resp:
                    answer = json.loads(resp.read())
                break
            except (ConnectionError, urllib.error.URLError):
                if proc.poll() is not None or time.time() > deadline:
                    raise StageFailed("the server did not answer")
                time.sleep(1)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()
    return 0, f"PUT /api -> {len(answer['text'][0])} characters"


def stage_zeroshot(c: Check):
    figures = []
    for task, data, extra in (("WIKITEXT103", "wiki.test.tokens", ["--overlapping-eval", "32"]),
                              ("LAMBADA", "lambada_test.jsonl", ["--strict-lambada"])):
        out = c.sh("zeroshot", [*c.torchrun(1), "tasks/main.py", "--task", task, "--valid-data",
                                os.path.join(c.data, "zeroshot", data), "--load",
                                os.path.join(c.ck, "gpt"), "--use-checkpoint-args",
                                *c.gpt_tokenizer(), "--micro-batch-size", "8", *extra])
        m = re.search(r"(ppl|accuracy)[^:]*:\s*([0-9.eE+\-]+)", out, re.IGNORECASE)
        figures.append(f"{task} {m.group(1)} {m.group(2)}" if m else f"{task} ran")
    return 0, "; ".join(figures)


def stage_bert(c: Check):
    out = c.sh("bert", [*c.torchrun(1), "pretrain_bert.py", "--mock-data", "--bf16",
                        "--num-layers", "2", "--hidden-size", "256",
                        "--num-attention-heads", "4", "--seq-length", "128",
                        "--max-position-embeddings", "128", "--micro-batch-size", "8",
                        "--global-batch-size", "8", "--lr", "1e-4", "--train-iters", "10",
                        "--log-interval", "1", "--eval-iters", "0",
                        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
                        os.path.join(c.data, "vocab.txt")])
    return 0, losses_figure(lm_losses(out))


def stage_finetune(c: Check):
    out = c.sh("finetune", [
        *c.torchrun(1), "tasks/main.py", "--task", "MNLI", "--seed", "1234",
        "--train-data", os.path.join(c.data, "MNLI", "train.tsv"),
        "--valid-data", os.path.join(c.data, "MNLI", "dev_matched.tsv"),
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
        os.path.join(c.data, "vocab.txt"), "--epochs", "2", "--bf16",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "16", "--global-batch-size", "16", "--lr", "5e-3",
        "--lr-decay-style", "linear", "--lr-warmup-fraction", "0.065", "--clip-grad", "1.0",
        "--log-interval", "8", "--eval-interval", "1000", "--eval-iters", "2"])
    m = re.findall(r"accuracy[^0-9]*([0-9.]+)", out)
    return 0, f"MNLI accuracy {m[-1]}" if m else "MNLI ran"


def stage_parallel(c: Check, stage: str, flags: list[str]):
    """Two processes on the one GPU over gloo (NCCL refuses two ranks on one device)."""
    # The whole-weight CPU draw: the same start weights as the one-GPU stages, so the losses
    # compare with gpt-bf16's.
    out = train(c, stage, ["--bf16", "--train-iters", "10", "--distributed-backend", "gloo",
                           "--use-cpu-initialization", *flags], nproc=2)
    return 0, losses_figure(lm_losses(out))


# CP=2 against CP=1 of the same run: bf16 on the GPU (the ring's blocks on the flash kernel)
# drifts by rounding only, fp32 on the CPU (the math path) by reduction order; a wrong block or
# merge moves the loss by more.
CP_LOSS_TOL = {"--bf16": 0.05, "--fp32": 1e-3}


def stage_cp2(c: Check):
    """A Llama-shaped model at --context-parallel-size 2 (two ranks on the GPU, each with half
    of every sequence) and at CP=1: the same losses."""
    precision = "--bf16" if c.gpu else "--fp32"  # bf16 is emulated, slowly, on most CPUs
    flags = [*([precision] if c.gpu else []), "--train-iters", "6", *LLAMA_FLAGS]
    reference = lm_losses(train(c, "cp2", flags))
    losses = lm_losses(train(c, "cp2", [*flags, "--context-parallel-size", "2",
                                        "--distributed-backend", "gloo"], nproc=2))
    common = sorted(set(losses) & set(reference))
    if len(common) < 6:
        raise StageFailed(f"iterations {sorted(losses)} vs CP=1's {sorted(reference)}")
    worst = max(abs(losses[i] - reference[i]) for i in common)
    if worst > CP_LOSS_TOL[precision]:
        raise StageFailed(f"CP=2 losses differ from CP=1 by {worst:.3g}")
    return 0, f"{losses_figure(losses)}; max diff to CP=1 {worst:.1e}"


def stage_kernels(c: Check):
    c.wait_for_build("kernels")
    device = "cuda" if c.gpu else "cpu"
    out = c.sh("kernels", [PY, "bench/check_kernels.py", "--device", device,
                           "--json", os.path.join(c.out, "kernels.json"),
                           *([] if c.gpu else ["--small", "--reps", "3", "--no-compile"])])
    return 0, out.strip().splitlines()[-1]


def speed(c: Check, stage: str, shape: str, sides: str, extra: list[str]):
    c.wait_for_build(stage)
    if not c.gpu:
        shape = {"llama": "llama-small", "mixtral": "mixtral-tiny"}.get(shape.split("-")[0],
                                                                         "small")
        extra = [*extra, "--steps", "2", "--warmup", "1"]
    out = c.sh(stage, [PY, "bench/gpu_speed.py", "--shape", shape, "--sides", sides,
                       "--json", os.path.join(c.out, f"{stage}.json"), *extra],
               env=dict(c.env, MEGATRON_CHECK_COLLECTIVES="0"))
    lines = [ln for ln in out.splitlines() if " ms/step" in ln]
    return 0, "; ".join(re.sub(r", first step.*", "", ln.split(": ", 1)[0].split(" ", 1)[1]
                               + ": " + ln.split(": ", 1)[1]) for ln in lines)


def report_env(c: Check) -> dict:
    """The speed stages' environment; the CPU smoke at one thread (two threads of a tiny model on
    a loaded 2-core machine spin-wait each other: seen 40x slower)."""
    threads = {} if c.gpu else {"OMP_NUM_THREADS": "1"}
    return dict(c.env, MEGATRON_CHECK_COLLECTIVES="0", **threads)


NO_TRANSFORMERS = (None, "skipped: transformers not installed (put its wheels in --wheels)")


def run_report_script(c: Check, stage: str, script: str, shape: str) -> dict | None:
    """Run a report-only comparison against transformers (``bench/<script>``) at ``shape`` and
    return its JSON; None where transformers is not installed (the stage is skipped)."""
    if not c.installed("transformers"):
        return None
    c.wait_for_build(stage)
    result = os.path.join(c.out, f"{stage}.json")
    c.sh(stage, [PY, script, "--shape", shape, "--json", result], env=report_env(c))
    with open(result) as f:
        return json.load(f)


def speed_bert(c: Check):
    """Report-only: BERT-base seq 512 training steps, ours against HF's BertForPreTraining."""
    res = run_report_script(c, "speed-bert", "bench/gpu_speed_bert.py",
                            "bert-base" if c.gpu else "tiny")
    if res is None:
        return NO_TRANSFORMERS
    sides = res["results"]
    figure = "; ".join(
        f"{name} {r['ms']:.1f} ms/step, {r['tokens_per_s'] / 1e3:.1f}k tok/s"
        + ("" if r["peak_GiB"] is None else f", peak {r['peak_GiB']:.2f} GiB")
        for name, r in sides.items())
    figure += f"; ours/HF {sides['hf']['ms'] / sides['ours']['ms']:.2f}x"
    return 0, figure + f"; same-function loss diff {res['check']['diff']:.1e}"


def speed_generate(c: Check):
    """Report-only: greedy generation tokens/s with the KV cache, ours against HF generate()."""
    res = run_report_script(c, "speed-generate", "bench/gpu_speed_generate.py",
                            "gpt2" if c.gpu else "tiny")
    if res is None:
        return NO_TRANSFORMERS
    return 0, "; ".join(
        f"batch {r['batch']}: ours {r['ours']['tokens_per_s']:.0f} vs HF "
        f"{r['hf']['tokens_per_s']:.0f} tok/s ({r['ours/HF']:.2f}x), {r['agreement']}"
        for r in res["results"])


STAGES = [
    Stage("env", stage_env, timeout=60),
    Stage("build", stage_build, timeout=420),
    Stage("data", stage_data, timeout=150),
    Stage("gpt-bf16", stage_gpt_bf16, ("data",)),
    Stage("gpt-fp16", stage_gpt_fp16, ("data",)),
    Stage("gpt-distopt", stage_gpt_distopt, ("data",)),
    Stage("llama", stage_llama, ("data",)),
    Stage("moe", stage_moe, ("data",), timeout=300),
    Stage("bert", stage_bert, ("data",)),
    Stage("finetune", stage_finetune, ("data",)),
    Stage("tp2", lambda c: stage_parallel(c, "tp2", ["--tensor-model-parallel-size", "2"]),
          ("data",)),
    Stage("pp2", lambda c: stage_parallel(c, "pp2", ["--pipeline-model-parallel-size", "2"]),
          ("data",)),
    Stage("tp2-sp", lambda c: stage_parallel(c, "tp2-sp", ["--tensor-model-parallel-size", "2",
                                                           "--sequence-parallel"]), ("data",)),
    Stage("cp2", stage_cp2, ("data",), timeout=300),
    Stage("resume", stage_resume, ("gpt-bf16",)),
    Stage("gpt-compiled", stage_gpt_compiled, ("gpt-bf16",), timeout=300),
    Stage("eval-gpu", stage_eval_gpu, ("gpt-bf16",)),
    Stage("eval-cpu", stage_eval_cpu, ("eval-gpu",), needs_gpu=True),
    Stage("convert", stage_convert, ("gpt-bf16",)),
    Stage("generate", stage_generate, ("gpt-bf16",)),
    Stage("generate-tp2", stage_generate_tp2, ("convert", "generate")),
    Stage("server", stage_server, ("gpt-bf16",)),
    Stage("zeroshot", stage_zeroshot, ("gpt-bf16",)),
    Stage("kernels", stage_kernels, timeout=240, exclusive=True),
    # ours-compiled (--compile-layers) before ours: each model is freed before the next builds.
    Stage("speed-gpt2", lambda c: speed(c, "speed-gpt2", "gpt2",
                                        "plain,compile,ours-compiled,ours,ours-unfused-ce,"
                                        "ours-noext",
                                        ["--profile", os.path.join(c.out, "profile_gpt2.txt")]),
          timeout=300, exclusive=True),
    Stage("speed-gpt2-distopt", lambda c: speed(c, "speed-gpt2-distopt", "gpt2", "ours",
                                                ["--ours-args=--use-distributed-optimizer"]),
          timeout=120, exclusive=True),
    Stage("speed-1.3b", lambda c: speed(c, "speed-1.3b", "1.3b", "plain,ours-compiled,ours", []),
          timeout=300, exclusive=True),
    # A Llama-style ~0.93B model: ours against transformers' LlamaForCausalLM (the machine's image
    # has transformers; without it, ours alone).
    Stage("speed-llama", lambda c: speed(
        c, "speed-llama", "llama-1b",
        "hf,ours-compiled,ours" if c.installed("transformers") else "ours-compiled,ours", []),
          timeout=240, exclusive=True),
    # A Mixtral-shaped MoE (8 experts, top-2, grouped GEMM): ours against transformers'
    # MixtralForCausalLM of the same shape. Report-only.
    Stage("speed-moe", lambda c: speed(
        c, "speed-moe", "mixtral-small",
        "hf,ours" if c.installed("transformers") else "ours", []),
          timeout=240, exclusive=True),
    # Report-only (no target).
    Stage("speed-bert", speed_bert, timeout=120, exclusive=True),
    Stage("speed-generate", speed_generate, timeout=150, exclusive=True),
]


class Runner:
    def __init__(self, check: Check, stages: list[Stage], jobs: int) -> None:
        self.c, self.stages, self.jobs = check, stages, jobs
        self.results: dict[str, Result] = {}
        self.lock = threading.Lock()

    def run_stage(self, stage: Stage) -> Result:
        start = time.time()
        failed = [d for d in stage.deps if d in self.results and self.results[d].rc != 0]
        if failed:
            result = Result(stage.name, None, 0.0, f"skipped: {', '.join(failed)} failed")
        elif stage.needs_gpu and not self.c.gpu:
            result = Result(stage.name, None, 0.0, "skipped: needs a GPU (none here)")
        else:
            self.c.deadline[stage.name] = start + stage.timeout
            try:
                rc, figure = stage.run(self.c)
            except StageFailed as exc:
                rc, figure = 1, f"FAILED {exc}"
            except Exception as exc:  # noqa: BLE001 - a broken stage must not stop the others
                rc, figure = 1, f"FAILED {type(exc).__name__}: {exc}"[:200]
            result = Result(stage.name, rc, time.time() - start, figure)
        with self.lock:
            self.results[stage.name] = result
            self.write()
        print(result.row(), flush=True)
        return result

    def write(self) -> None:
        rows = [self.results[s.name] for s in self.stages if s.name in self.results]
        with open(os.path.join(self.c.out, "gpu_check.md"), "w") as f:
            f.write("| stage | rc | seconds | key figure |\n|---|---|---|---|\n")
            f.write("\n".join(r.row() for r in rows) + "\n")
        with open(os.path.join(self.c.out, "gpu_check.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps(dataclasses.asdict(r)) + "\n")

    def run(self) -> None:
        build = next((s for s in self.stages if s.name == "build"), None)
        if build is None:
            self.c.build_done.set()
        pending = [s for s in self.stages if not s.exclusive and s is not build]
        with cf.ThreadPoolExecutor(max_workers=self.jobs + 1) as pool:
            building = pool.submit(self.run_stage, build) if build else None
            running: dict[str, cf.Future] = {}
            while pending or running:
                for stage in list(pending):
                    if all(d in self.results or d not in self.names() for d in stage.deps) \
                            and len(running) < self.jobs:
                        pending.remove(stage)
                        running[stage.name] = pool.submit(self.run_stage, stage)
                done, _ = cf.wait(list(running.values()), timeout=0.5,
                                  return_when=cf.FIRST_COMPLETED)
                for name in [n for n, f in running.items() if f in done]:
                    running.pop(name)
            if building is not None:
                building.result()
        for stage in self.stages:
            if stage.exclusive:
                self.run_stage(stage)

    def names(self) -> set[str]:
        return {s.name for s in self.stages}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "gpu_check_out"))
    parser.add_argument("--only", default="", help="comma-separated stages (deps not added)")
    parser.add_argument("--skip", default="", help="comma-separated stages to leave out")
    parser.add_argument("--jobs", type=int, default=4, help="functional stages at a time")
    parser.add_argument("--wheels", default=os.path.join(ROOT, ".whl"))
    parser.add_argument("--list", action="store_true", help="list the stages and exit")
    args = parser.parse_args()
    names = [s.name for s in STAGES]
    if args.list:
        for s in STAGES:
            print(f"{s.name:<20} deps: {', '.join(s.deps) or '-'}; timeout {s.timeout:.0f} s"
                  f"{'; alone, last' if s.exclusive else ''}{'; GPU only' if s.needs_gpu else ''}")
        return 0
    only = [n for n in args.only.split(",") if n]
    skip = [n for n in args.skip.split(",") if n]
    unknown = sorted(set(only + skip) - set(names))
    if unknown:
        parser.error(f"unknown stage(s) {unknown}; --list shows them")
    stages = [s for s in STAGES if (not only or s.name in only) and s.name not in skip]
    gpu = cuda_available()
    check = Check(args.out, args.wheels, gpu)
    print(f"gpu_check: {'GPU' if gpu else 'no GPU: a CPU smoke run'}; out {check.out}; "
          f"{len(stages)} stages", flush=True)
    t0 = time.time()
    runner = Runner(check, stages, args.jobs)
    runner.run()
    print(f"\n## gpu_check ({time.time() - t0:.0f} s)\n")
    with open(os.path.join(check.out, "gpu_check.md")) as f:
        print(f.read())
    return 0 if all(r.rc in (0, None) for r in runner.results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
