"""Serve a checkpoint over HTTP: Megatron's ``PUT /api``, an OpenAI-style ``POST /v1/completions``
(with streaming) and a web page at ``/``.

    torchrun --nproc-per-node 2 tools/run_text_generation_server.py --load ckpt/ \
        --use-checkpoint-args --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json \
        --merge-file merges.txt --port 5000

Rank 0 serves HTTP on ``--host`` (127.0.0.1 unless given; Megatron binds 0.0.0.0) and
broadcasts each request to the other ranks, which run it with it (tensor parallelism).
``tools/text_generation_cli.py 127.0.0.1:5000`` is the interactive client.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.config.cli import parse_command_line  # noqa: E402
from megatron.config.validate import ToolChecks, refuse_context_parallel  # noqa: E402
from megatron.core import comm, device, parallel_state  # noqa: E402
from megatron.core.log import log_rank_0  # noqa: E402
from megatron.text_generation.api import (follow_requests, lead_request,  # noqa: E402
                                          stop_followers)
from megatron.text_generation.server.engine import GenerationEngine  # noqa: E402
from megatron.training import fault  # noqa: E402
from megatron.training.checkpointing import load_checkpoint  # noqa: E402
from megatron.training.initialize import (  # noqa: E402
    build_tokenizer_from_config, initialize_from_config)
from megatron.training.models import gpt_model_from  # noqa: E402
from megatron.training.inference import (  # noqa: E402
    check_checkpoint_to_load, weights_only)

_PROG = "tools/run_text_generation_server.py"


@dataclasses.dataclass(kw_only=True)
class ServerFlags:
    """Where and how to serve."""

    host: str = "127.0.0.1"
    """Address to bind (Megatron binds 0.0.0.0; give --host 0.0.0.0 to serve other machines)."""
    port: int = 5000
    """Port to serve on (0 picks a free one; the log says which)."""
    max_queue_size: int = 16
    """Requests that may wait while one runs; more get 503."""
    max_request_bytes: int = 1 << 20
    """Largest request body accepted (larger: 413)."""
    max_connections: int = 64
    """Connections handled at once; more are answered 503 at once (a flood of clients, or of
    slow ones, cannot exhaust threads and memory)."""
    client_timeout: float = 30.0
    """Seconds a client has to send its whole request, and that one write to it (a streamed
    token) may wait for it to read; past them the connection is closed."""
    kv_cache: bool = True
    """Keep keys and values between steps (--no-kv-cache recomputes every step: slower, for
    checking)."""


TOOL_SECTIONS = [(ServerFlags, "text generation server")]


def check_server_flags(ex: ServerFlags) -> None:
    """Raises: ValueError naming the flag."""
    if not 0 <= ex.port <= 65535:
        raise ValueError(f"--port ({ex.port}) must be in [0, 65535]")
    if ex.max_queue_size < 1:
        raise ValueError(f"--max-queue-size ({ex.max_queue_size}) must be >= 1")
    if ex.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes ({ex.max_request_bytes}) must be >= 1024")
    if ex.max_connections < 1:
        raise ValueError(f"--max-connections ({ex.max_connections}) must be >= 1")
    if not ex.client_timeout > 0 or ex.client_timeout == float("inf"):
        raise ValueError(f"--client-timeout ({ex.client_timeout}) must be a finite number of "
                         "seconds > 0")


def _check_flags_given(flags) -> None:
    check_server_flags(flags.section(ServerFlags))
    check_checkpoint_to_load(flags.checkpoint.load, flags.checkpoint.ckpt_step,
                             flags.checkpoint.random_weights, purpose="serve")


def _check_config(cfg) -> None:
    if cfg.parallel.num_layers_per_virtual_pipeline_stage is not None:
        raise ValueError("--num-layers-per-virtual-pipeline-stage is for training (the "
                         "interleaved schedule): serve without it")


# Run by validate(), before any process group starts; an error exits on one line.
TOOL_CHECKS = ToolChecks(given=[_check_flags_given,
                                refuse_context_parallel("the generation server")],
                         validated=[_check_config])


def run(argv: list[str] | None = None) -> None:
    """Parse, check, load, then serve (rank 0) or follow rank 0's requests (the other ranks)
    until SIGINT/SIGTERM; the process group is left as it is (see :func:`main`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    flags, parser = parse_command_line(argv, prog=_PROG, tool_sections=TOOL_SECTIONS)
    cfg = initialize_from_config(weights_only(flags), parser, tool_checks=TOOL_CHECKS)
    ex = cfg.section(ServerFlags)
    stop = _StopSignals()
    tokenizer = build_tokenizer_from_config(cfg)
    model = gpt_model_from(cfg, inference=True).to(device.get_device())
    if not cfg.checkpoint.random_weights:
        load_checkpoint([model], None, None, cfg)
    model.eval()
    # Every rank takes part in every request: the world is the model-parallel group here.
    group, src = comm.world_group(), 0
    common = dict(max_sequence_length=cfg.model.max_position_embeddings,
                  use_kv_cache=ex.kv_cache, mp_group=group,
                  pp_group=parallel_state.get_pipeline_model_parallel_group(), src=src)
    if comm.rank(group) != src:
        follow_requests(model, tokenizer, **common)  # until the leader's shutdown
    else:
        serve(model, tokenizer, ex, common, stop)


class _StopSignals:
    """SIGINT / SIGTERM on every rank: torchrun passes a SIGTERM to every rank and Ctrl-C
    reaches the whole process group, so a follower must not die of it (the leader's shutdown
    broadcast would then fail on a closed connection). The leader stops serving; the followers
    return when it tells them to."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.name: str | None = None
        self.on_stop = lambda: None
        fault.handle_stop_signals()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        if not self.event.is_set():
            self.name = signal.Signals(signum).name
            self.event.set()
            self.on_stop()


def main(argv: list[str] | None = None) -> None:
    run(argv)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def serve(model, tokenizer, ex: ServerFlags, common: dict, stop: _StopSignals) -> None:
    """Rank 0: HTTP until SIGINT/SIGTERM, then stop the other ranks."""
    from megatron.text_generation.server.app import create_app
    from megatron.text_generation.server.serving import BoundedServer

    engine = GenerationEngine(
        lambda request, on_step: lead_request(model, tokenizer, request, on_step=on_step,
                                              **common),
        max_queue=ex.max_queue_size)
    app = create_app(engine, tokenizer, max_sequence_length=common["max_sequence_length"],
                     max_body_bytes=ex.max_request_bytes)
    server = BoundedServer(ex.host, ex.port, app, max_connections=ex.max_connections,
                           client_timeout_s=ex.client_timeout)
    stop.on_stop = lambda: threading.Thread(target=server.shutdown, daemon=True).start()
    if stop.event.is_set():  # a signal while the model loaded
        stop.on_stop()
    log_rank_0(f"serving on http://{ex.host}:{server.server_port} (PUT /api, "
               "POST /v1/completions, web page at /)")
    try:
        server.serve_forever()
    finally:
        engine.close()
        stop_followers(common["mp_group"], common["src"])
        log_rank_0(f"server stopped ({stop.name or 'shut down'}): every rank exits")


if __name__ == "__main__":
    fault.run_rank(main)
