"""The server: Megatron's ``PUT /api`` shape and every field's bounds, OpenAI's
``/v1/completions`` (streaming included), malformed and oversize bodies, a full queue,
concurrent requests, a stream cut by the client, a failure inside generation; healthy after."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from megatron.text_generation.api import GenerationRequest
from megatron.text_generation.server.engine import GenerationEngine, Job, QueueFull
from megatron.text_generation.server.fields import MAX_PROMPTS

GOOD = {"prompts": ["Hello"], "tokens_to_generate": 4}


def _healthy(client):
    response = client.put("/api", json={**GOOD, "top_k": 1})
    assert response.status_code == 200, response.get_json()
    return response.get_json()


def test_api_in_megatrons_shape(client, harness):
    body = client.put("/api", json={"prompts": ["Hello", "Hi there"], "tokens_to_generate": 5,
                                    "logprobs": True, "top_k": 1}).get_json()
    assert set(body) == {"text", "segments", "logprobs"}
    direct = harness.direct(GenerationRequest(prompts=["Hello", "Hi there"],
                                              tokens_to_generate=5, logprobs=True, top_k=1))
    assert body["text"] == direct.text and body["segments"] == direct.segments
    for lps, segs in zip(body["logprobs"], body["segments"]):
        assert len(lps) == len(segs) - 1
    assert client.put("/api", json=GOOD).get_json()["logprobs"] is None
    scored = client.put("/api", json={"prompts": ["Hello"], "tokens_to_generate": 0,
                                      "logprobs": True}).get_json()
    assert scored["text"] == ["Hello"] and len(scored["logprobs"][0]) == 4
    beam = client.put("/api", json={"prompts": ["Hi"], "tokens_to_generate": 4,
                                    "beam_width": 2}).get_json()
    assert set(beam) == {"text", "segments", "scores"} and len(beam["text"]) == 2


BAD_API_FIELDS = [
    ({"prompts": None}, "prompts argument required"),  # None: the field is left out
    ({"prompts": "Hello"}, "prompts is not a list of strings"),
    ({"prompts": [1]}, "prompts is not a list of strings"),
    ({"prompts": []}, "prompts is empty"),
    ({"prompts": ["a"] * (MAX_PROMPTS + 1)}, "Maximum number of prompts is 128"),
    ({"prompts": [""]}, "Empty prompts require add_BOS=true"),
    ({"max_len": 3}, "max_len is no longer used"),
    ({"sentences": ["a"]}, "sentences is no longer used"),
    ({"tokens_to_generate": -1}, "tokens_to_generate must be an integer in [0, 96]"),
    ({"tokens_to_generate": "4"}, "tokens_to_generate must be an integer"),
    ({"tokens_to_generate": True}, "tokens_to_generate must be an integer"),
    ({"tokens_to_generate": 97}, "tokens_to_generate must be an integer in [0, 96]"),
    ({"tokens_to_generate": 95}, "prompts[0] has 5 tokens; with tokens_to_generate=95"),
    ({"tokens_to_generate": 0}, "tokens_to_generate=0 implies logprobs should be True"),
    ({"logprobs": 1}, "logprobs must be a boolean value"),
    ({"temperature": 0}, "temperature must be a finite number > 0.0 and <= 100.0"),
    ({"temperature": 100.5}, "temperature must be a finite number > 0.0 and <= 100.0"),
    ({"temperature": "hot"}, "temperature must be a finite number"),
    ({"top_k": -1}, "top_k must be an integer in [0, 1000]"),
    ({"top_k": 1001}, "top_k must be an integer in [0, 1000]"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"top_p": 1.5}, "top_p must be a finite number >= 0.0 and <= 1.0"),
    ({"top_p": -0.1}, "top_p must be a finite number >= 0.0 and <= 1.0"),
    ({"top_k": 2, "top_p": 0.5}, "cannot set both top-k and top-p samplings."),
    ({"top_p_decay": 0.5}, "top_p_decay cannot be set without top_p"),
    ({"top_p": 0.5, "top_p_decay": 2}, "top_p_decay must be a finite number >= 0.0 and <= 1.0"),
    ({"top_p_bound": 0.1}, "top_p_bound cannot be set without top_p"),
    ({"top_p": 0.5, "top_p_bound": 0.7}, "top_p_bound (0.7) must be <= top_p (0.5)"),
    ({"add_BOS": "yes"}, "add_BOS must be a boolean value"),
    ({"stop_on_double_eol": 0}, "stop_on_double_eol must be a boolean value"),
    ({"stop_on_eol": None}, "stop_on_eol must be a boolean value"),
    ({"prevent_newline_after_colon": []}, "prevent_newline_after_colon must be a boolean"),
    ({"random_seed": -2}, "random_seed must be a non-negative integer"),
    ({"random_seed": 2**64}, "random_seed must be a non-negative integer"),
    ({"no_log": "x"}, "no_log must be a boolean value"),
    ({"beam_width": 0}, "beam_width must be an integer in [1, 64]"),
    ({"beam_width": 2, "prompts": ["a", "b"]}, "When doing beam_search, batch size must be 1"),
    ({"stop_token": -1}, "stop_token must be an integer in [0, 256]"),
    ({"stop_token": 257}, "stop_token must be an integer in [0, 256]"),  # past the vocabulary
    ({"length_penalty": "long"}, "length_penalty must be a finite number"),
]


@pytest.mark.parametrize("fields,message", BAD_API_FIELDS)
def test_api_field_bounds(client, fields, message):
    body = {k: v for k, v in {**GOOD, **fields}.items() if not (k == "prompts" and v is None)}
    response = client.put("/api", json=body)
    assert response.status_code == 400
    assert message in response.get_json(), response.get_json()


BAD_COMPLETION_FIELDS = [
    ({"prompt": None}, "prompt is not a list of strings"),
    ({"prompt": 5}, "prompt is not a list of strings"),
    ({"max_tokens": -1}, "max_tokens must be an integer in [0, 96]"),
    ({"max_tokens": 0}, "max_tokens=0 returns nothing unless echo is true"),
    ({"max_tokens": 95}, "prompt[0] has 5 tokens; with max_tokens=95"),
    ({"temperature": 2.5}, "temperature must be a finite number >= 0.0 and <= 2.0"),
    ({"top_p": 0}, "top_p must be a finite number > 0.0 and <= 1.0"),
    ({"top_k": 3, "top_p": 0.5}, "cannot set both top_k and top_p"),
    ({"logprobs": 11}, "logprobs must be an integer in [0, 10]"),
    ({"logprobs": True}, "logprobs must be an integer"),
    ({"echo": "yes"}, "echo must be a boolean value"),
    ({"stream": 1}, "stream must be a boolean value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop must be a non-empty string or a list"),
    ({"stop": [""]}, "stop must be a non-empty string or a list"),
    ({"n": 2}, "n must be 1"),
    ({"seed": -1}, "seed must be a non-negative integer"),
    ({"model": 3}, "model must be a string"),
]


@pytest.mark.parametrize("fields,message", BAD_COMPLETION_FIELDS)
def test_completion_field_bounds(client, fields, message):
    response = client.post("/v1/completions", json={"prompt": "Hello", **fields})
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_malformed_and_oversize_bodies(client):
    for path, method in (("/api", client.put), ("/v1/completions", client.post)):
        response = method(path, data=b"{not json", content_type="application/json")
        assert response.status_code == 400
        assert "not valid JSON" in json.dumps(response.get_json())
        response = method(path, data=b"[1, 2]", content_type="application/json")
        assert response.status_code == 400
        response = method(path, data=b"{" + b" " * (1 << 17) + b"}",
                          content_type="application/json")
        assert response.status_code == 413
        assert "request body larger than 65536 bytes" in json.dumps(response.get_json())
    assert client.get("/api").status_code == 405
    _healthy(client)


def test_completions_in_openais_shape(client, harness):
    body = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6,
                                                "temperature": 0, "logprobs": 2,
                                                "echo": True}).get_json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    choice = body["choices"][0]
    direct = harness.direct(GenerationRequest(prompts=["Hello"], tokens_to_generate=6, top_k=1))
    assert choice["text"] == direct.text[0].replace("<|endoftext|>", "")
    assert choice["finish_reason"] in ("length", "stop") and choice["index"] == 0
    lp = choice["logprobs"]
    assert lp["tokens"][:5] == list("Hello") and lp["token_logprobs"][0] is None
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"])
    assert lp["text_offset"][:3] == [0, 1, 2]
    # Keyed by token text, as OpenAI's: two ids with one text (split UTF-8 bytes) share a key.
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])
    assert lp["top_logprobs"][0] is None
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}


def test_stop_strings_cut_the_text(client, harness):
    free = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 12,
                                                "temperature": 0}).get_json()
    text = free["choices"][0]["text"]
    stop = text[3:5]
    cut = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 12,
                                               "temperature": 0, "stop": [stop]}).get_json()
    choice = cut["choices"][0]
    assert choice["text"] == text[:text.index(stop)] and choice["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] <= free["usage"]["completion_tokens"]


def _events(lines):
    out = []
    for line in lines:
        line = line.decode() if isinstance(line, bytes) else line
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_stream_equals_the_whole_answer(client):
    request = {"prompt": ["Hello", "Hi"], "max_tokens": 8, "temperature": 0, "logprobs": 1}
    whole = client.post("/v1/completions", json=request).get_json()
    response = client.post("/v1/completions", json={**request, "stream": True})
    assert response.mimetype == "text/event-stream"
    events = _events(response.get_data(as_text=True).split("\n\n"))
    assert events[-1] == "[DONE]"
    for i in range(2):
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in chunks) == whole["choices"][i]["text"]
        assert chunks[-1]["finish_reason"] == whole["choices"][i]["finish_reason"]
        tokens = [c["logprobs"] for c in chunks if c["logprobs"]]
        assert len(tokens) == whole["usage"]["completion_tokens"] // 2  # one event a token
        assert set(tokens[0]) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert tokens[0]["text_offset"] == [len(request["prompt"][i])]


def test_queue_full_is_503_and_the_slot_frees():
    release = threading.Event()

    def held(request, on_step):
        release.wait(30)
        raise ValueError("released")

    engine = GenerationEngine(held, max_queue=1)
    try:
        first = engine.submit(Job(GenerationRequest(prompts=["a"])))
        deadline = time.monotonic() + 10
        while engine.queued() and time.monotonic() < deadline:  # the worker took it
            time.sleep(0.01)
        engine.submit(Job(GenerationRequest(prompts=["b"])))
        with pytest.raises(QueueFull, match="server busy"):
            engine.submit(Job(GenerationRequest(prompts=["c"])))
        from megatron.text_generation.server.app import create_app
        from tests.text_generation.tiny import ByteTokenizer
        app = create_app(engine, ByteTokenizer(), max_sequence_length=96)
        response = app.test_client().put("/api", json=GOOD)
        assert response.status_code == 503 and "server busy" in response.get_json()
        release.set()
        with pytest.raises(ValueError, match="released"):
            first.result(10)
        engine.submit(Job(GenerationRequest(prompts=["d"])))  # room again
    finally:
        release.set()
        engine.close()


def test_a_failure_in_generation_fails_only_that_request(client, harness):
    harness.fail_next = True
    response = client.put("/api", json=GOOD)
    assert response.status_code == 500 and "injected failure" in response.get_json()
    harness.fail_next = True
    response = client.post("/v1/completions", json={"prompt": "Hello"})
    assert response.status_code == 500
    _healthy(client)
    assert harness.engine.stats["failed"] == 2


def test_concurrent_requests_all_answered_none_mixed_up(harness):
    prompts = [f"Prompt number {i}" for i in range(8)]
    expected = {p: harness.direct(GenerationRequest(prompts=[p], tokens_to_generate=6,
                                                    top_k=1)).text[0] for p in prompts}
    with harness.serving() as url:
        def ask(prompt):
            response = requests.put(f"{url}/api", json={"prompts": [prompt],
                                                        "tokens_to_generate": 6, "top_k": 1},
                                    timeout=60)
            return prompt, response.status_code, response.json()

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, prompts))
    for prompt, status, body in answers:
        assert status == 200 and body["text"] == [expected[prompt]]


def test_a_stream_cut_by_the_client_frees_its_slot(harness):
    harness.step_delay = 0.05  # 80 steps: 4 s if nobody stops it
    with harness.serving() as url:
        response = requests.post(f"{url}/v1/completions", stream=True, timeout=60,
                                 json={"prompt": "Hello", "max_tokens": 80, "stream": True})
        seen = 0
        for line in response.iter_lines():
            if line.startswith(b"data: "):
                seen += 1
                if seen == 2:
                    break
        response.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 30
        while harness.engine.stats["cancelled"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert harness.engine.stats["cancelled"] == 1
        harness.step_delay = 0.0
        health = requests.get(f"{url}/health", timeout=10).json()
        assert health["status"] == "ok" and health["queued"] == 0
        answer = requests.put(f"{url}/api", json={**GOOD, "top_k": 1}, timeout=60)
        assert answer.status_code == 200


def test_the_page_is_served(client):
    response = client.get("/")
    assert response.status_code == 200 and b"<textarea" in response.data
