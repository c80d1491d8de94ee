"""Interactive client of the text generation server (Megatron-LM's ``text_generation_cli.py``):

    python tools/text_generation_cli.py 127.0.0.1:5000

asks for a prompt and a number of tokens, sends ``PUT /api`` and prints the text; Ctrl-D or an
empty line at the prompt ends it. Unlike Megatron's it never ``eval``s what is typed, and a
server error (400, 503...) is printed with its message instead of ending the client.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

_TIMEOUT_S = 600.0


def put_api(address: str, prompt: str, tokens_to_generate: int) -> tuple[int, object]:
    """``PUT http://address/api``; returns (status, decoded JSON body)."""
    url = address if address.startswith("http") else f"http://{address}"
    body = json.dumps({"prompts": [prompt], "tokens_to_generate": tokens_to_generate})
    req = urllib.request.Request(f"{url}/api", data=body.encode(), method="PUT",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=_TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, raw.decode(errors="replace")


def _ask_tokens() -> int:
    while True:
        answer = input("Enter number of tokens to generate: ").strip()
        if answer.isdigit():
            return int(answer)
        print("please enter a whole number >= 0")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: text_generation_cli.py HOST:PORT", file=sys.stderr)
        return 2
    try:
        while True:
            prompt = input("Enter prompt: ")
            if not prompt:
                return 0
            status, body = put_api(argv[0], prompt, _ask_tokens())
            if status != 200:
                message = body.get("message", body) if isinstance(body, dict) else body
                print(f"Error {status}: {message}")
            else:
                print("Megatron Response: ")
                print(body["text"][0])
    except EOFError:
        return 0
    except urllib.error.URLError as err:
        print(f"cannot reach {argv[0]}: {err.reason}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
