"""Write small files in the zero-shot tasks' formats from plain text already on this machine
(nothing is downloaded), for trying ``tasks/main.py`` before the real data is at hand.

    python tasks/zeroshot_gpt/sample_data.py --text-dir ../shared/data/corpus --output-dir DIR

* ``DIR/wiki.test.tokens``: WikiText-103's word-level layout (a space before every token,
  punctuation split off, ``@-@`` / ``@,@`` / ``@.@`` inside words and numbers, `` 's``,
  `` = Title = `` headings, blank `` `` lines between paragraphs);
* ``DIR/lambada_test.jsonl``: LAMBADA's layout, ``{"text": passage}`` per line, each passage
  ending with its target word (no final punctuation).

These are *not* WikiText-103 or LAMBADA: numbers measured on them compare checkpoints with each
other, not with the paper's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

_PUNCTUATION = re.compile(r"([,.;:!?()\"\[\]])")


def word_level(text: str) -> str:
    """One paragraph in WikiText's word-level form (without the line's end)."""
    text = re.sub(r"(\d),(\d)", r"\1 @,@ \2", text)
    text = re.sub(r"(\d)\.(\d)", r"\1 @.@ \2", text)
    text = re.sub(r"(\w)-(\w)", r"\1 @-@ \2", text)
    text = _PUNCTUATION.sub(r" \1 ", text)
    text = re.sub(r"(\w)'(s|t|ll|re|ve|d|m)\b", r"\1 '\2", text)
    return " ".join(text.split())


def paragraphs(text_dir: Path, max_chars: int) -> list[str]:
    """Paragraphs (blank-line separated, lines joined) of the ``*.txt`` files, in name order."""
    found, size = [], 0
    for path in sorted(text_dir.rglob("*.txt")):
        text = path.read_text(encoding="utf-8", errors="replace").lstrip("\ufeff")
        for block in re.split(r"\n\s*\n", text):
            block = " ".join(block.split())
            if len(block.split()) < 8:
                continue
            found.append(block)
            size += len(block)
            if size >= max_chars:
                return found
    return found


def write_wikitext(paras: list[str], path: Path) -> None:
    lines = [" \n", " = Sample text = \n", " \n"]
    for number, para in enumerate(paras):
        if number % 12 == 11:
            lines += [f" = = Part {number // 12 + 1} = = \n", " \n"]
        lines += [f" {word_level(para)} \n", " \n"]
    path.write_text("".join(lines), encoding="utf-8")


def lambada_passages(paras: list[str], max_words: int) -> list[str]:
    """Passages of whole sentences, at most ``max_words`` words, ending with a word."""
    passages = []
    for para in paras:
        words = para.split()[:max_words]
        while words and not re.search(r"[A-Za-z]{3,}[.!?]$", words[-1]):
            words.pop()
        if len(words) >= 8:
            words[-1] = words[-1].rstrip(".!?")
            passages.append(" ".join(words))
    return passages


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text-dir", required=True, help="directory of *.txt files")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--wikitext-chars", type=int, default=60000)
    parser.add_argument("--lambada-max-words", type=int, default=60,
                        help="passage length cap (keep the tokens under --seq-length)")
    args = parser.parse_args(argv)
    paras = paragraphs(Path(args.text_dir), args.wikitext_chars)
    if not paras:
        raise SystemExit(f"--text-dir {args.text_dir}: no *.txt paragraphs found")
    out = Path(args.output_dir)
    os.makedirs(out, exist_ok=True)
    write_wikitext(paras, out / "wiki.test.tokens")
    with open(out / "lambada_test.jsonl", "w", encoding="utf-8") as lam:
        for passage in lambada_passages(paras, args.lambada_max_words):
            lam.write(json.dumps({"text": passage}) + "\n")
    print(f"wrote {out / 'wiki.test.tokens'} and {out / 'lambada_test.jsonl'}")


if __name__ == "__main__":
    main()
