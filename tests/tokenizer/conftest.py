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
