"""The text of one OpenAI completion as tokens arrive: stop strings, streaming deltas that never
take back what was sent, and the ``logprobs`` object.

A delta holds back an unfinished UTF-8 character (the detokenizer shows it as U+FFFD) and any
tail that could be the start of a stop string, so a streamed completion never shows text the
finished one does not have. The end-of-document token is not shown (OpenAI's texts never
contain it; Megatron's ``/api`` keeps it).
"""

from __future__ import annotations

from collections.abc import Callable

from megatron.text_generation.generation import StepReport

_PARTIAL_CHAR = "\ufffd"


class CompletionText:
    """One prompt's completion text.

    Args:
        tokenizer: detokenizes ids; its ``eod`` is never shown.
        prompt_ids: the prompt's ids.
        stops: stop strings (the completion ends before the first one).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.eod = getattr(tokenizer, "eod", None)
        self.prompt_ids = list(prompt_ids)
        self.prompt_text = tokenizer.detokenize(self.prompt_ids)
        self.generated: list[int] = []
        self.sent = 0
        self.stop_hit = False
        self.final_text: str | None = None
        self.finish_reason: str | None = None

    def _text_of(self, generated: list[int]) -> str:
        """The generated ids' text as it reads after the prompt (tokenizers that join ids with
        spaces, or merge across the seam, give it only from the whole sequence)."""
        whole = self.tokenizer.detokenize(self.prompt_ids + generated)
        if whole.startswith(self.prompt_text):
            return whole[len(self.prompt_text):]
        return self.tokenizer.detokenize(generated)

    def _cut(self, text: str) -> tuple[str, bool]:
        ends = [text.find(s) for s in self.stops if s in text]
        return (text[:min(ends)], True) if ends else (text, False)

    def _held_back(self, text: str) -> str:
        """``text`` less a tail that may still change (a split character, a stop's start)."""
        text = text.rstrip(_PARTIAL_CHAR)
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    return text[:-n]
        return text

    def add(self, token: int) -> str:
        """Take the next generated token; returns the new text to show (maybe "")."""
        if self.stop_hit or token == self.eod:
            return ""
        self.generated.append(token)
        text, self.stop_hit = self._cut(self._text_of(self.generated))
        safe = text if self.stop_hit else self._held_back(text)
        delta = safe[self.sent:]
        self.sent = max(self.sent, len(safe))
        return delta

    def finish(self, ids: list[int], stopped: bool) -> str:
        """The whole row (prompt + generated) is known: fix the final text and finish reason;
        returns what was not sent yet."""
        generated = ids[len(self.prompt_ids):]
        if generated and generated[-1] == self.eod:
            generated = generated[:-1]
        text, hit = self._cut(self._text_of(generated))
        self.final_text = text
        self.finish_reason = "stop" if stopped or hit else "length"
        rest = text[self.sent:]
        self.sent = len(text)
        return rest

    def visible(self, echo: bool) -> str:
        assert self.final_text is not None, "finish() first"
        return self.prompt_text + self.final_text if echo else self.final_text

    def logprobs_object(self, result, row: int, echo: bool, top: int) -> dict:
        """OpenAI's ``logprobs``: the shown tokens, their log-probs (the first prompt token has
        none), the ``top`` most likely tokens at each, and each token's offset in prompt +
        completion."""
        ids = result.tokens[row]
        segments = [self.tokenizer.detokenize([i]) for i in ids]
        offsets, at = [], 0
        for seg in segments:
            offsets.append(at)
            at += len(seg)
        end = len(self.prompt_text) + len(self.final_text or "")
        first = 0 if echo else len(self.prompt_ids)
        keep = [j for j in range(first, len(ids))
                if offsets[j] < end or (j < len(self.prompt_ids) and echo)]
        lps = result.logprobs[row] if result.logprobs is not None else []
        tops = result.top_logprobs[row] if result.top_logprobs is not None else None
        out = {"tokens": [segments[j] for j in keep],
               "token_logprobs": [lps[j - 1] if j > 0 else None for j in keep],
               "top_logprobs": None, "text_offset": [offsets[j] for j in keep]}
        if top > 0 and tops is not None:
            out["top_logprobs"] = [
                None if j == 0 else {self.tokenizer.detokenize([t]): v
                                     for t, v in zip(*tops[j - 1])} for j in keep]
        return out


def stop_watch(tokenizer, prompts: list[list[int]], stops: list[str]
               ) -> Callable[[StepReport], list[bool]]:
    """A per-step check (run on the generation thread) that asks to stop each row whose text
    now holds a stop string."""
    texts = [CompletionText(tokenizer, p, stops) for p in prompts]

    def watch(report: StepReport) -> list[bool]:
        for row, token in zip(report.rows, report.tokens):
            texts[row].add(token)
        return [t.stop_hit for t in texts]

    return watch
