"""The user documentation stays true to the code, without running any command it shows.

* Every relative link of the Markdown files (README.md, bench/README.md, docs/**) names a file
  that exists, and every ``#anchor`` into a Markdown file names one of its headings.
* Every path under the docs folder named in the Markdown files, the Python sources, the shell
  scripts and examples exists.
* Every command of a fenced shell block in the docs (``python X.py``, ``torchrun ... X.py``,
  ``python -m pkg.mod``) names only flags its script's real argument parser accepts. The parser
  is captured as the script builds it: the script runs as ``__main__`` with
  ``argparse.ArgumentParser.parse_args`` patched to stop at its first call, so nothing past
  argument parsing runs.
* README.md stays under 250 lines.

New pages are picked up by globbing; nothing here lists the pages.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
_SKIP_DIRS = {".venv", "build", ".git", "__pycache__", ".pytest_cache", "quickstart_out",
              "gpu_check_out", ".whl"}
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_DOCS_PATH = re.compile(r"(?<![\w./-])docs/(?:[\w.-]+/)*[\w-]+\.\w+")
_FENCE = re.compile(r"^```(\w*)\s*$")
_SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
_PYTHONS = re.compile(r"^(\S*/)?python3?$")
_TORCHRUN = re.compile(r"^(\S*/)?torchrun$")
_ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _repo_files() -> list[Path]:
    """The repository's files: tracked and untracked-but-not-ignored (so outputs the documented
    commands write, e.g. an exported HF model's README.md, are left out), else a walk."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
            capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
        return sorted({REPO / name for name in listed if name and (REPO / name).is_file()})
    except (OSError, subprocess.SubprocessError):
        return sorted(path for path in REPO.rglob("*") if path.is_file() and not any(
            part in _SKIP_DIRS or part.endswith(".egg-info")
            for part in path.relative_to(REPO).parts))


def _walk(suffixes: tuple[str, ...]) -> list[Path]:
    return [path for path in _repo_files() if path.name.endswith(suffixes)]


def _markdown_files() -> list[Path]:
    return [p for p in _walk((".md",)) if p.relative_to(REPO).parts[0] != "tests"]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    anchors, in_fence = set(), False
    for line in md.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def _outside_fences(text: str) -> str:
    """The text with fenced code blocks blanked (a link inside a block is not a link)."""
    out, in_fence = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            out.append("")
        else:
            out.append("" if in_fence else line)
    return "\n".join(out)


def test_relative_links_resolve():
    broken = []
    for md in _markdown_files():
        for target in _LINK.findall(_outside_fences(md.read_text(encoding="utf-8"))):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            path_part, _, anchor = target.partition("#")
            dest = (md.parent / path_part).resolve() if path_part else md
            rel = md.relative_to(REPO)
            if not dest.exists():
                broken.append(f"{rel}: link to {target}: {dest} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{rel}: link to {target}: no heading with anchor #{anchor}")
    assert not broken, "\n".join(broken)


def test_docs_paths_exist():
    me = Path(__file__).resolve()
    missing = []
    for path in _markdown_files() + _walk((".py", ".sh", ".cpp", ".h", ".toml")):
        if path.resolve() == me:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            for name in _DOCS_PATH.findall(line):
                if not (REPO / name.rstrip(".")).exists():
                    missing.append(f"{path.relative_to(REPO)}:{lineno}: {name}")
    assert not missing, "paths named but absent:\n" + "\n".join(missing)


def test_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines (limit {README_MAX_LINES})"


# -- command blocks ---------------------------------------------------------------------------

def _shell_blocks(md: Path) -> list[tuple[int, str]]:
    """(first line number, logical line) of every command in the fenced shell blocks."""
    commands, lang, start, pending = [], None, 0, ""
    for lineno, line in enumerate(md.read_text(encoding="utf-8").splitlines(), 1):
        fence = _FENCE.match(line)
        if fence:
            lang = fence.group(1) if lang is None else None
            pending = ""
            continue
        if lang not in _SHELL_LANGS or lang is None:
            continue
        code = "" if line.lstrip().startswith("#") else line
        code = re.sub(r"\s+#\s.*$", "", code)  # a trailing comment
        if not pending:
            start = lineno
        if code.rstrip().endswith("\\"):
            pending += code.rstrip()[:-1] + " "
            continue
        logical = (pending + code).strip()
        pending = ""
        if logical:
            commands.append((start, logical))
    return commands


def _tokens(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


def _target(tokens: list[str]) -> tuple[str, list[str]] | None:
    """("path/to/script.py" or "-m module", the tokens after it) of a python/torchrun command."""
    i = 0
    while i < len(tokens) and _ENV_ASSIGN.match(tokens[i]):
        i += 1
    if i >= len(tokens):
        return None
    head = tokens[i]
    if _PYTHONS.match(head):
        rest = tokens[i + 1:]
        if rest[:1] == ["-m"] and len(rest) > 1:
            return f"-m {rest[1]}", rest[2:]
        return (rest[0], rest[1:]) if rest and rest[0].endswith(".py") else None
    if _TORCHRUN.match(head):
        for j in range(i + 1, len(tokens)):
            if tokens[j].endswith(".py"):
                return tokens[j], tokens[j + 1:]
    return None


def _flags(args: list[str]) -> list[str]:
    out = []
    for tok in args:
        tok = tok.strip("[]")
        if tok.startswith("--") and len(tok) > 2 and not tok.startswith("--<"):
            out.append(tok.split("=", 1)[0])
    return out


class _Captured(BaseException):  # BaseException: passes the scripts' ``except Exception``
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__()
        self.parser = parser


@contextlib.contextmanager
def _capturing_parsers():
    def stop(self, *args, **kwargs):
        raise _Captured(self)

    import megatron.training.fault as fault

    saved = (argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args,
             fault.run_rank, sys.argv)
    argparse.ArgumentParser.parse_args = stop
    argparse.ArgumentParser.parse_known_args = stop
    fault.run_rank = lambda main: main()
    try:
        yield
    finally:
        (argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args,
         fault.run_rank, sys.argv) = saved


_PARSER_FLAGS: dict[str, set[str] | str] = {}


def _accepted(target: str) -> set[str] | str:
    """The option strings of ``target``'s parser, or why it could not be captured."""
    if target in _PARSER_FLAGS:
        return _PARSER_FLAGS[target]
    result: set[str] | str = f"{target} reached no argparse parser"
    with _capturing_parsers(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before
        try:
            if target.startswith("-m "):
                module = target[3:]
                sys.argv = [module]
                runpy.run_module(module, run_name="__main__", alter_sys=False)
            else:
                sys.argv = [str(REPO / target)]
                runpy.run_path(str(REPO / target), run_name="__main__")
        except _Captured as captured:
            result = set(captured.parser._option_string_actions)
        except BaseException as exc:  # noqa: BLE001 - reported as the test's failure
            result = f"{target} failed before parsing its flags: {exc!r}"
    _PARSER_FLAGS[target] = result
    return result


def _ours(target: str) -> bool:
    if target.startswith("-m "):
        return target[3:].split(".")[0] in {"megatron", "tasks", "tools", "bench"}
    return (REPO / target).is_file()


def _doc_commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for md in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for lineno, command in _shell_blocks(md):
            target = _target(_tokens(command))
            if target is None:
                continue
            script, rest = target
            flags = _flags(rest)
            if flags:
                found.append((f"{md.relative_to(REPO)}:{lineno}", script, flags))
    return found


def test_doc_commands_name_accepted_flags():
    commands = _doc_commands()
    assert commands, "no python/torchrun command found in the docs' shell blocks"
    problems = []
    for where, script, flags in commands:
        if not _ours(script):
            if not script.startswith("-m "):
                problems.append(f"{where}: {script} is not a file of this repository")
            continue
        accepted = _accepted(script)
        if isinstance(accepted, str):
            problems.append(f"{where}: {accepted}")
            continue
        unknown = [f for f in flags if f not in accepted]
        if unknown:
            problems.append(f"{where}: {script} does not accept {', '.join(unknown)} (its "
                            "parser as built at its first parse_args call)")
    assert not problems, "\n".join(problems)


def test_command_block_parsing():
    """The block reader joins continuations, drops comments and finds the script."""
    tokens = _tokens("PYTHONPATH=. .venv/bin/python bench/x.py --a 1 [--b] <flags> --c=2")
    assert _target(tokens) == ("bench/x.py", ["--a", "1", "[--b]", "<flags>", "--c=2"])
    assert _flags(_target(tokens)[1]) == ["--a", "--b", "--c"]
    assert _target(_tokens("torchrun --nproc-per-node 2 tasks/main.py --task X"))[0] == \
        "tasks/main.py"
    assert _target(_tokens("python -m megatron.core.parallel_state --world-size 8"))[0] == \
        "-m megatron.core.parallel_state"
    assert _target(_tokens("curl -X PUT localhost:5000/api")) is None
    assert _slug("Compiled layers (`--compile-layers`)") == "compiled-layers---compile-layers"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
