"""Beam search on a hand-checkable bigram model (the next token's probabilities depend only on
the last token), Megatron's hypothesis bookkeeping, and cache = recompute on a real GPT."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.text_generation import BeamHypotheses, beam_search
from tests.text_generation.tiny import MAX_POSITIONS, tiny_model

STOP = 5


class Bigram(torch.nn.Module):
    """Logits = log of a fixed next-token table row for each position's token."""

    def __init__(self, table: dict[int, dict[int, float]], vocab: int = 6) -> None:
        super().__init__()
        probs = torch.full((vocab, vocab), 1e-6, dtype=torch.float64)
        for prev, row in table.items():
            for nxt, p in row.items():
                probs[prev, nxt] = p
        self.probs = probs / probs.sum(-1, keepdim=True)
        self.logits = self.probs.log()

    def logp(self, prev: int, nxt: int) -> float:
        return math.log(float(self.probs[prev, nxt]))

    def forward(self, ids, positions, mask, inference_params=None):
        return self.logits[ids]  # [b, s, V]


# From 0: 1 is likelier than 2, but after 1 everything is flat, after 2 the stop is sure.
TABLE = {0: {1: 0.55, 2: 0.45}, 1: {3: 0.25, 4: 0.25, 0: 0.25, 1: 0.25},
         2: {STOP: 0.99}, 3: {3: 1.0}, 4: {4: 1.0}}


def _search(beam_width, n=3, penalty=1.0, model=None, **kwargs):
    return beam_search(model or Bigram(TABLE), [0], n, beam_width=beam_width,
                       max_sequence_length=16, stop_token=STOP, length_penalty=penalty,
                       num_return=beam_width, vocab_size=6, **kwargs)


def test_beam_finds_what_greedy_misses():
    model = Bigram(TABLE)
    out = _search(2, model=model)
    # [0, 2, STOP]: log(.45) + log(.99) over 2 tokens beats any path through 1 (<= .55 * .25).
    assert out.tokens[0] == [0, 2, STOP]
    assert out.scores[0] == pytest.approx((model.logp(0, 2) + model.logp(2, STOP)) / 2,
                                          abs=1e-12)
    # Width 1 is greedy: through 1, then a flat row, run to the length limit.
    greedy = _search(1)
    assert greedy.tokens[0][:2] == [0, 1] and len(greedy.tokens[0]) == 4


def test_length_penalty_weighs_the_length():
    # With length_penalty 0 the raw sum decides; with 2 the longer open beam is favoured more.
    model = Bigram(TABLE)
    raw = _search(2, penalty=0.0, model=model)
    assert raw.scores[0] == pytest.approx(model.logp(0, 2) + model.logp(2, STOP), abs=1e-12)
    long = _search(2, n=3, penalty=2.0)
    assert long.scores == sorted(long.scores, reverse=True)


def test_hypotheses_keep_the_best():
    hyps = BeamHypotheses(2, length_penalty=1.0)
    hyps.add([1], -4.0, 2)  # -2
    hyps.add([2], -1.0, 1)  # -1
    hyps.add([3], -9.0, 3)  # -3: worse than both, dropped
    assert sorted(t for _, t in hyps.beams) == [[1], [2]] and hyps.worst_score == -2.0
    hyps.add([4], -0.5, 1)  # -0.5 pushes out -2
    assert sorted(t for _, t in hyps.beams) == [[2], [4]] and hyps.worst_score == -1.0
    assert hyps.is_done(-3.0, 2) and not hyps.is_done(-1.0, 2)


def test_refusals():
    with pytest.raises(ValueError, match="beam_width"):
        _search(0)
    with pytest.raises(ValueError, match="candidate tokens"):
        _search(4)  # 8 candidates from a vocabulary of 6


def test_cache_equals_recompute_on_a_gpt():
    model = tiny_model()
    args = dict(beam_width=3, max_sequence_length=MAX_POSITIONS, stop_token=256,
                num_return=3, vocab_size=257)
    cached = beam_search(model, [72, 105, 33], 10, **args)
    full = beam_search(model, [72, 105, 33], 10, use_kv_cache=False, **args)
    assert cached.tokens == full.tokens
    assert cached.scores == pytest.approx(full.scores, abs=1e-9)
    assert len(cached.tokens) == 3 and len(set(map(tuple, cached.tokens))) == 3
