"""Beam search for one prompt (Megatron-LM's ``beam_search_and_return_on_first_stage`` and
``BeamHypotheses``).

The prompt is copied ``beam_width`` times. At each step every beam's next-token log-probs are
added to its running score; of the ``2 * beam_width`` best (beam, token) pairs, a pair ending in
the stop token becomes a finished hypothesis (only if it ranks among the first ``beam_width``),
the others continue, up to ``beam_width`` of them. The KV cache rows follow their beams
(``swap_key_value_dict``). A finished hypothesis is scored ``sum_logprobs / length **
length_penalty`` (length counts the generated tokens, the stop token included); search ends when
no open beam can beat the worst kept hypothesis, or at ``tokens_to_generate``, when the open
beams join the hypotheses.

Legend: b beams, s sequence, V padded vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.core import comm, device
from megatron.core.inference_params import InferenceParams
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.utils import ProcessGroup
from megatron.text_generation.generation import (StageForward, check_generation_lengths,
                                                 last_stage_rank, model_tp_group)


class BeamHypotheses:
    """The ``num_beams`` best finished sequences and their length-penalized scores."""

    def __init__(self, num_beams: int, length_penalty: float = 1.0) -> None:
        self.num_beams, self.length_penalty = num_beams, length_penalty
        self.beams: list[tuple[float, list[int]]] = []
        self.worst_score = 1e9

    def __len__(self) -> int:
        return len(self.beams)

    def add(self, tokens: list[int], sum_logprobs: float, length: int) -> None:
        """Keep ``tokens`` if there is room or it beats the worst kept hypothesis."""
        score = sum_logprobs / length ** self.length_penalty
        if len(self) < self.num_beams or score > self.worst_score:
            self.beams.append((score, tokens))
            if len(self) > self.num_beams:
                ranked = sorted((s, i) for i, (s, _) in enumerate(self.beams))
                del self.beams[ranked[0][1]]
                self.worst_score = ranked[1][0]
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_sum_logprobs: float, length: int) -> bool:
        """No open beam (best running score ``best_sum_logprobs``) can still enter."""
        if len(self) < self.num_beams:
            return False
        return self.worst_score >= best_sum_logprobs / length ** self.length_penalty


@dataclass
class BeamOutput:
    """The best hypotheses, best first: token ids (prompt included) and scores."""

    tokens: list[list[int]]
    scores: list[float]


@torch.no_grad()
def beam_search(model: torch.nn.Module, prompt: list[int], tokens_to_generate: int, *,
                beam_width: int, max_sequence_length: int, stop_token: int,
                length_penalty: float = 1.0, num_return: int = 1,
                vocab_size: int | None = None, colon: int | None = None,
                eol: int | None = None, prevent_newline_after_colon: bool = False,
                use_kv_cache: bool = True, mp_group: ProcessGroup | None = None,
                pp_group: ProcessGroup | None = None, src: int = 0) -> BeamOutput:
    """Beam search from one prompt; returns up to ``num_return`` hypotheses, best first.

    Raises:
        ValueError: an empty prompt, one that leaves no room for a token, a beam width < 1 or
            one that the vocabulary cannot fill (2 x beam_width candidates per step).
    """
    if beam_width < 1:
        raise ValueError(f"beam_width ({beam_width}) must be >= 1")
    check_generation_lengths([len(prompt)], tokens_to_generate, max_sequence_length)
    if tokens_to_generate < 1:
        raise ValueError("beam search needs tokens_to_generate >= 1")
    model.eval()
    search = _Search(model, prompt, tokens_to_generate, beam_width, length_penalty, vocab_size,
                     use_kv_cache, mp_group, src, pp_group)
    if 2 * beam_width > search.vocab:
        raise ValueError(f"beam_width ({beam_width}) needs 2 x {beam_width} candidate tokens; "
                         f"the vocabulary has {search.vocab}")
    return search.run(stop_token, num_return, colon if prevent_newline_after_colon else None,
                      eol)


class _Search:
    def __init__(self, model, prompt, tokens_to_generate, beam_width, length_penalty,
                 vocab_size, use_kv_cache, mp_group, src, pp_group) -> None:
        self.model, self.mp_group, self.src = model, mp_group, src
        self.dev = device.get_device()
        self.beam_width = beam_width
        self.prompt_length = len(prompt)
        self.final_length = len(prompt) + tokens_to_generate
        self.tokens = torch.tensor([prompt], dtype=torch.long, device="cpu").repeat(beam_width, 1)  # [b, s]
        self.tokens = torch.cat([self.tokens, torch.zeros(beam_width, tokens_to_generate,
                                                          dtype=torch.long, device="cpu")], dim=1)
        self.scores = torch.zeros(beam_width, 1, dtype=torch.float64, device="cpu")  # [b, 1]
        self.hyps = BeamHypotheses(beam_width, length_penalty)
        self.cache = InferenceParams(beam_width, self.final_length) if use_kv_cache else None
        self.tp_group = model_tp_group(model)
        self.forward, self.pp_group = StageForward(model, pp_group), pp_group
        self.last = self.forward.last
        self.vocab = vocab_size if vocab_size is not None else \
            model.config.padded_vocab_size

    def log_probs(self, start: int, end: int) -> torch.Tensor | None:
        """Next-token logits ``[b, V]`` after position ``end - 1`` (last stage; else None)."""
        first = start if self.cache is not None else 0
        ids = self.tokens[:, first:end].to(self.dev)  # [b, s]
        positions = torch.arange(first, end, device=self.dev).unsqueeze(0).expand_as(ids)
        logits = self.forward(ids, positions, self.cache)  # [b, s, V/p] or None
        if self.cache is not None:
            self.cache.sequence_len_offset = end
        if logits is None:
            return None
        logits = logits[:, -1, :]  # [b, V/p]
        if self.tp_group is not None:
            logits = gather_from_tensor_model_parallel_region(logits, self.tp_group)  # [b, V]
        logits = logits.cpu().double()
        logits[:, self.vocab:] = float("-inf")  # padded vocabulary entries
        return logits

    def run(self, stop_token, num_return, colon, eol) -> BeamOutput:
        done = False
        prev = 0
        for context in range(self.prompt_length, self.final_length):
            logits = self.log_probs(prev, context)
            kept = torch.zeros(self.beam_width, 3, dtype=torch.float64, device="cpu")
            if logits is not None:
                kept, done = self.rank_candidates(logits, context, stop_token, colon, eol)
            done = self.agree(kept, context, done)
            if done:
                break
            prev = context
        if not self.last:
            return comm.broadcast_object(None, last_stage_rank(self.pp_group), self.pp_group)
        if not done:
            for i in range(self.beam_width):
                self.hyps.add(self.tokens[i, :self.final_length].tolist(),
                              float(self.scores[i]), self.final_length - self.prompt_length)
        best = sorted(self.hyps.beams, key=lambda item: item[0], reverse=True)[:num_return]
        out = BeamOutput(tokens=[t for _, t in best], scores=[s for s, _ in best])
        if comm.world_size(self.pp_group) > 1:  # the other stages take the last one's answer
            comm.broadcast_object(out, last_stage_rank(self.pp_group), self.pp_group)
        return out

    def rank_candidates(self, logits, context, stop_token, colon, eol
                        ) -> tuple[torch.Tensor, bool]:
        """The last stage's step: the kept beams ``[b, 3]`` and whether search is done."""
        if colon is not None and eol is not None:
            logits[self.tokens[:, context - 1] == colon, eol] = -1e10
        new_scores = F.log_softmax(logits, dim=-1) + self.scores  # [b, V]
        # At the first step all beams are the same prompt: rank one row only.
        flat = new_scores[0] if context == self.prompt_length else new_scores.view(-1)
        order_scores, order = torch.sort(flat, descending=True)
        beams, words = order // logits.size(1), order % logits.size(1)
        kept = self.step(context, stop_token, beams, words, order_scores)
        done = self.hyps.is_done(float(order_scores[:2 * self.beam_width].max()),
                                 context + 1 - self.prompt_length)
        return kept, done

    def step(self, context, stop_token, beams, words, scores) -> torch.Tensor:
        """Finish the candidates ending in ``stop_token``, keep ``beam_width`` others; returns
        ``[b, 3]`` rows (beam, token, score) of the kept ones."""
        kept = []
        for rank in range(2 * self.beam_width):
            beam, word, score = int(beams[rank]), int(words[rank]), float(scores[rank])
            if word == stop_token:
                if rank < self.beam_width:  # a stop outside the top beam_width is ignored
                    self.hyps.add(self.tokens[beam, :context].tolist() + [word], score,
                                  context + 1 - self.prompt_length)
            else:
                kept.append((beam, word, score))
            if len(kept) == self.beam_width:
                break
        return torch.tensor(kept, dtype=torch.float64, device="cpu")

    def agree(self, kept: torch.Tensor, context: int, done: bool) -> bool:
        """Every rank takes the last stage's beams (over the pipeline), then ``src``'s (over
        every rank), and reorders its tokens and cache."""
        shared = torch.cat([kept.view(-1), torch.tensor([float(done)], dtype=torch.float64, device="cpu")])
        shared = shared.to(self.dev)
        if comm.world_size(self.pp_group) > 1:
            comm.broadcast(shared, last_stage_rank(self.pp_group), self.pp_group)
        comm.broadcast(shared, self.src, self.mp_group)
        shared = shared.cpu()
        kept = shared[:-1].view(self.beam_width, 3)
        beams = kept[:, 0].long()
        self.tokens = self.tokens[beams]
        self.tokens[:, context] = kept[:, 1].long()
        self.scores = kept[:, 2:3].clone()
        if self.cache is not None:
            self.cache.swap_key_value_dict(beams)
        return bool(shared[-1])
