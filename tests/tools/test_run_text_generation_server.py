"""tools/run_text_generation_server.py as a user starts it (a real process on 127.0.0.1), used by
curl-like requests and by tools/text_generation_cli.py; bad flags are refused before any
model is built; SIGTERM stops it cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from bench.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "tools" / "run_text_generation_server.py"
CLI = ROOT / "tools" / "text_generation_cli.py"
MODEL = ("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --max-position-embeddings 32 "
         "--seq-length 32 --tokenizer-type NullTokenizer --vocab-size 50 "
         "--distributed-backend gloo --random-weights").split()


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("extra,message", [
    (["--port", "70000"], "--port (70000) must be in [0, 65535]"),
    (["--max-queue-size", "0"], "--max-queue-size (0) must be >= 1"),
])
def test_bad_flags_refused(extra, message):
    from tools import run_text_generation_server as tool

    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        tool.main(MODEL + extra)


def test_server_and_cli_smoke():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), *MODEL, "--port", str(port)],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.3)
        answer = requests.put(f"{url}/api", json={"prompts": ["1 2 3"], "tokens_to_generate": 4,
                                                  "logprobs": True, "top_k": 1}, timeout=60)
        body = answer.json()
        assert answer.status_code == 200 and body["text"][0].startswith("1 2 3 ")
        assert len(body["segments"][0]) == 7 and len(body["logprobs"][0]) == 6
        bad = requests.put(f"{url}/api", json={"prompts": ["1"], "top_k": -1}, timeout=60)
        assert bad.status_code == 400 and "top_k" in bad.json()
        stream = requests.post(f"{url}/v1/completions", timeout=60, stream=True,
                               json={"prompt": "1 2 3", "max_tokens": 4, "temperature": 0,
                                     "stream": True})
        events = [line[6:] for line in stream.iter_lines(decode_unicode=True)
                  if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert body["text"][0] == "1 2 3" + streamed
        cli = subprocess.run([sys.executable, str(CLI), f"127.0.0.1:{port}"], cwd=ROOT,
                             input="4 5 6\n3\n\n", capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert "Megatron Response: \n4 5 6 " in cli.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert f"serving on http://127.0.0.1:{port}" in out and "server stopped" in out
