"""Requests through the command loop: rank 0 leads, the other ranks follow, and the answers at
TP = 2 and at PP = 2 (generation, beam search, a refused request, sampling) equal one process's; Megatron's post-processing (segments, log-probs, add_BOS)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.core import comm
from megatron.core import parallel_state as ps
from megatron.text_generation import (GenerationRequest, follow_requests, lead_request,
                                      run_request, stop_followers)
from tests.multiprocess import run_distributed
from tests.text_generation.tiny import MAX_POSITIONS, ByteTokenizer, tiny_model, tiny_stage

REQUESTS = [
    GenerationRequest(prompts=["Hello", "A longer prompt"], tokens_to_generate=8,
                      logprobs=True, top_k=1),
    GenerationRequest(prompts=["Hi"], tokens_to_generate=6, beam_width=2),
    GenerationRequest(prompts=["x" * 95], tokens_to_generate=8, top_k=1),  # too long: refused
    GenerationRequest(prompts=["Sampled"], tokens_to_generate=8, top_p=0.9, random_seed=3),
]


def _run_all(model, tokenizer, group, pp_group=None):
    out = []
    for request in REQUESTS:
        try:
            out.append(lead_request(model, tokenizer, request, mp_group=group,
                                    pp_group=pp_group, max_sequence_length=MAX_POSITIONS))
        except ValueError as err:
            out.append(str(err))
    return out


def _command_loop(rank, world_size, tp, pp):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tp_group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    model = tiny_stage(tp_group, ps.get_pipeline_model_parallel_rank(), pp,
                       attention_backend="unfused")
    tokenizer, group = ByteTokenizer(), comm.world_group()
    pp_group = ps.get_pipeline_model_parallel_group()
    if rank == 0:
        results = _run_all(model, tokenizer, group, pp_group)
        stop_followers(group)
        return results
    return follow_requests(model, tokenizer, mp_group=group, pp_group=pp_group,
                           max_sequence_length=MAX_POSITIONS)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_command_loop_at_tp2_and_pp2_equals_one_process(tp, pp):
    leader, followed = run_distributed(2, _command_loop, tp, pp)
    assert followed == len(REQUESTS)
    single = _run_all(tiny_model(attention_backend="unfused"), ByteTokenizer(), None)
    for tp2, tp1 in zip(leader, single):
        if isinstance(tp1, str):
            assert tp2 == tp1 and "prompt 0 has 95 tokens" in tp1
            continue
        assert tp2.tokens == tp1.tokens and tp2.text == tp1.text
        if tp1.logprobs is not None:
            for a, b in zip(tp2.logprobs, tp1.logprobs):
                assert a == pytest.approx(b, abs=1e-5)
        if tp1.scores is not None:
            assert tp2.scores == pytest.approx(tp1.scores, abs=1e-5)


def test_post_processing_in_megatrons_shape():
    tokenizer = ByteTokenizer()
    request = dataclasses.replace(REQUESTS[0], add_BOS=True)
    result = run_request(tiny_model(), tokenizer, request, max_sequence_length=MAX_POSITIONS)
    for text, segments, tokens, lps in zip(result.text, result.segments, result.tokens,
                                           result.logprobs):
        assert tokens[0] == tokenizer.eod and text.startswith("<|endoftext|>")
        assert "".join(segments) == text and len(segments) == len(tokens)
        assert len(lps) == len(tokens) - 1
    assert result.prompt_lengths == [6, 16]
    assert run_request(tiny_model(), tokenizer, REQUESTS[0],
                       max_sequence_length=MAX_POSITIONS).text[0].startswith("Hello")
