"""Real text for tokenizer tests: slices of the shared corpus plus hand-made hard cases."""

from __future__ import annotations

from pathlib import Path

import pytest

# Whitespace runs, contractions, numbers, accents, CJK, emoji, control characters, lone
# combining marks, the literal special strings of each tokenizer.
HARD_CASES = [
    "",
    " ",
    "   leading and trailing   ",
    "tabs\tand\nnewlines\n\n\n  mixed \r\n end",
    "I'm, you're, we've, they'll, he'd, it's, ISN'T, o'clock, rock 'n' roll",
    "Numbers: 3.14159, 1,000,000, 2024-05-01, 0x1F, 1e-9, ½ ¾ ²",
    "Accents: café naïve résumé Ångström Øresund Ελληνικά ΟΔΟΣ Straße İstanbul",
    "CJK: 日本語のテキスト 中文字符 한국어 and mixed中text",
    "Emoji 😀👍🏽🇫🇷 and symbols ©®™ € £ ¥ ∑ ∫ → ★",
    "Control\x00chars\x07here\u200band\ufeffthere\ufffd and soft\u00adhyphen",
    "Combining: e\u0301 a\u0308 and lone \u0301 mark",
    "Specials: <|endoftext|> [SEP] [CLS] [MASK] <EOD> </s> <s>",
    "Punct!!! ... ??? --- ((( ))) \"quoted\" 'single' `back` ~tilde^caret$dollar",
    "a" * 150 + " " + "supercalifragilisticexpialidocious" * 4,
    "\u3000ideographic\u3000space and\u00a0nbsp and\u2009thin",
    # BERT corners where HF's BertNormalizer differs from Google's tokenization.py: words of
    # 101..200 characters, private-use / unassigned characters (kept by Google), CJK Extension
    # E (U+2B820..), punctuation newer than HF's Unicode tables, line/paragraph separators.
    "b" * 101 + " " + "c" * 200 + " " + "d" * 201 + " " + "ab" * 99 + "!",
    "x\ue000y private\U000F0000use \U00100001 unassigned\u0378here\U0003FFFD",
    "ext-E \U0002B820\U0002B8FFx and new punct a\u2E43b\u2E5Dc\u061Dd\U00011C70e",
    "line\u2028sep\u2029para \x1c\x1d\x1e\x1f unit\x0bsep\x0cff\x85nel",
]


@pytest.fixture(scope="session")
def corpus_texts(shared_data: Path) -> list[str]:
    """About 300 KB: four 10 KB slices from each corpus file (start, middle, end) + hard cases."""
    files = sorted((shared_data / "corpus").rglob("*.txt"))
    texts = []
    for file in files:
        text = file.read_text(encoding="utf-8")
        for frac in (0.0, 0.33, 0.66, 0.95):
            start = int(len(text) * frac)
            texts.append(text[start:start + 10_000])
    return texts + HARD_CASES
