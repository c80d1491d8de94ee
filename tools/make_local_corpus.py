"""Build a JSON-lines text corpus from text already on this machine (no download).

Sources, in order of preference: a directory of .txt books (``--text-dir``, e.g. the shared
Project Gutenberg books), else the documentation shipped with the OS (/usr/share/doc, licenses)
and the docstrings of Python's standard library. Each paragraph-sized chunk becomes one
``{"text": ...}`` line.
"""

from __future__ import annotations

import argparse
import json
import pkgutil
import re
import sys
from collections.abc import Iterator
from pathlib import Path

_MIN_CHARS = 200
_MAX_CHARS = 4000


def _chunks(text: str) -> Iterator[str]:
    """Merge paragraphs into chunks of roughly _MIN_CHARS.._MAX_CHARS characters."""
    buf = ""
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if not para:
            continue
        buf = f"{buf}\n\n{para}" if buf else para
        if len(buf) >= _MIN_CHARS:
            yield buf[:_MAX_CHARS]
            buf = ""
    if len(buf) >= 40:
        yield buf


def _book_texts(text_dir: Path) -> Iterator[str]:
    for path in sorted(text_dir.rglob("*.txt")):
        yield path.read_text(encoding="utf-8", errors="replace")


def _system_texts() -> Iterator[str]:
    for root in (Path("/usr/share/doc"), Path("/usr/share/common-licenses")):
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.suffix in ("", ".txt", ".md") and path.stat().st_size < 2e6:
                try:
                    yield path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
    import importlib

    for info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        if info.name.startswith("_") or info.name in ("antigravity", "this", "idlelib"):
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - any module that fails to import is skipped
            continue
        for obj in [module, *vars(module).values()]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > _MIN_CHARS:
                yield doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--output", required=True, help="JSON-lines file to write.")
    parser.add_argument("--text-dir", default=None,
                        help="Directory of .txt files to use (e.g. ../shared/data/corpus).")
    parser.add_argument("--max-mb", type=float, default=8.0, help="Stop after this many MiB.")
    args = parser.parse_args(argv)
    if args.text_dir and Path(args.text_dir).is_dir():
        texts, source = _book_texts(Path(args.text_dir)), args.text_dir
    else:
        texts, source = _system_texts(), "system documentation and Python docstrings"
    limit = int(args.max_mb * 2 ** 20)
    written = docs = 0
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for text in texts:
            for chunk in _chunks(text):
                line = json.dumps({"text": chunk}, ensure_ascii=False)
                f.write(line + "\n")
                written += len(line) + 1
                docs += 1
                if written >= limit:
                    break
            if written >= limit:
                break
    sys.stderr.write(f"wrote {docs} documents ({written / 2 ** 20:.1f} MiB) from {source} "
                     f"to {out}\n")
    return 0 if docs else 1


if __name__ == "__main__":
    sys.exit(main())
