"""Generation with the KV cache equals full recomputation (tokens identical, log-probs to 1e-5)
at TP = 1 and 2, for the GPT and for Llama-style models (RoPE, GQA; with --qk-layernorm, the
QKV bias, interleaved partial RoPE); a batch of prompts of different lengths equals each prompt
alone; Megatron's stop rules, scoring, top-p decay and seeded sampling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core import comm
from megatron.core import parallel_state as ps
from megatron.text_generation import (SamplingOptions, StopConditions, decay_top_p,
                                      generate_tokens_and_logprobs)
from tests.multiprocess import run_distributed
from tests.text_generation.tiny import MAX_POSITIONS, tiny_model, tiny_stage

PROMPTS = [[72, 101, 108, 108, 111], [87, 111, 114, 108, 100, 33, 32, 40, 41], [65]]
GREEDY = SamplingOptions(top_k=1)
NO_STOP = StopConditions(stop_on_eod=False)


def _generate(model, prompts, n=12, **kwargs):
    kwargs = {"sampling": GREEDY, "stops": NO_STOP, "return_logprobs": True, **kwargs}
    return generate_tokens_and_logprobs(model, prompts, n, max_sequence_length=MAX_POSITIONS,
                                        **kwargs)


def _assert_same(a, b, tol=1e-5):
    assert a.tokens == b.tokens
    for x, y in zip(a.logprobs, b.logprobs):
        assert len(x) == len(y)
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=tol, rtol=0)


@pytest.mark.parametrize("backend", ["auto", "unfused"])
def test_kv_cache_equals_recomputation(backend):
    model = tiny_model(attention_backend=backend)
    cached, full = _generate(model, PROMPTS), _generate(model, PROMPTS, use_kv_cache=False)
    _assert_same(cached, full)
    assert [len(t) for t in cached.tokens] == [len(p) + 12 for p in PROMPTS]
    # The outputs say something: not one token repeated (a dead model would pass anything).
    assert len(set(cached.tokens[0][5:])) > 1


LLAMA = dict(normalization="RMSNorm", swiglu=True, ffn_hidden_size=24,
             position_embedding_type="rope", num_query_groups=2, add_bias_linear=False,
             untie_embeddings_and_output_weights=True)
LLAMA_EXTRAS = [{}, {"qk_layernorm": True},
                {"qk_layernorm": True, "add_qkv_bias": True, "rotary_interleaved": True,
                 "rotary_percent": 0.5}]


def _llama(tp_group=None, **extras):
    """The tiny model Llama-style (RoPE, GQA: 4 heads in 2 groups); the q/k norms' weights off
    their all-ones init, so each of their channels counts."""
    model = tiny_model(tp_group, attention_backend="unfused", **LLAMA, **extras)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                param.copy_(torch.linspace(0.5, 1.5, param.numel(), dtype=param.dtype))
    return model


@pytest.mark.parametrize("extras", LLAMA_EXTRAS)
def test_llama_kv_cache_equals_recomputation(extras):
    """RoPE at the cache offset, only the G key/value heads cached, the q/k norms applied to
    each new token before RoPE: the cached steps equal recomputing the whole sequence."""
    model = _llama(**extras)
    cached, full = _generate(model, PROMPTS), _generate(model, PROMPTS, use_kv_cache=False)
    _assert_same(cached, full)
    assert len(set(cached.tokens[0][5:])) > 1


def test_kv_cache_fp32_within_1e5():
    model = tiny_model(dtype=torch.float32)
    _assert_same(_generate(model, PROMPTS), _generate(model, PROMPTS, use_kv_cache=False))


def test_batched_equals_one_by_one():
    model = tiny_model()
    batch = _generate(model, PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        alone = _generate(model, [prompt])
        assert alone.tokens[0] == batch.tokens[i]
        assert torch.allclose(torch.tensor(alone.logprobs[0]), torch.tensor(batch.logprobs[i]),
                              atol=1e-10)


def test_logprobs_are_the_models_own():
    """Each log-prob is log_softmax of one full forward over the finished sequence."""
    model = tiny_model()
    out = _generate(model, PROMPTS[:1], n=6)
    ids = torch.tensor(out.tokens)
    logits = model(ids[:, :-1], torch.arange(ids.size(1) - 1).unsqueeze(0), None)
    expected = F.log_softmax(logits.double(), -1).gather(2, ids[:, 1:, None]).view(-1)
    assert torch.allclose(torch.tensor(out.logprobs[0], dtype=torch.float64), expected, atol=1e-10)


def test_scoring_generates_nothing():
    model = tiny_model()
    scored = _generate(model, PROMPTS, n=0)
    generated = _generate(model, PROMPTS, n=3)
    for i, prompt in enumerate(PROMPTS):
        assert scored.tokens[i] == prompt
        assert len(scored.logprobs[i]) == len(prompt) - 1
        assert torch.allclose(torch.tensor(scored.logprobs[i]),
                              torch.tensor(generated.logprobs[i][:len(prompt) - 1]), atol=1e-10)


def test_stop_rules():
    model = tiny_model()
    free = _generate(model, PROMPTS[:1], n=12).tokens[0]
    gen = free[5:]
    stop = gen[3]
    first = gen.index(stop)
    # The end-of-document id ends the row, the stop token included.
    out = _generate(model, PROMPTS[:1], stops=StopConditions(eod=stop))
    assert out.tokens[0] == free[:5 + first + 1] and out.stopped == [True]
    # stop_token overrides eod; stop_on_eol stops on "\n" (here: that id) instead of eod.
    out = _generate(model, PROMPTS[:1], stops=StopConditions(eod=999, stop_token=stop))
    assert out.tokens[0] == free[:5 + first + 1]
    out = _generate(model, PROMPTS[:1], stops=StopConditions(eod=stop, eol=999,
                                                             stop_on_eol=True))
    assert out.tokens[0] == free and out.stopped == [False]
    out = _generate(model, PROMPTS[:1], stops=StopConditions(eol=stop, stop_on_eol=True))
    assert out.tokens[0] == free[:5 + first + 1]
    # double EOL: the "\n\n" id alone, or "\n" right after "\n".
    out = _generate(model, PROMPTS[:1], stops=StopConditions(double_eol=stop,
                                                             stop_on_double_eol=True))
    assert out.tokens[0] == free[:5 + first + 1]
    pair = next((j for j in range(1, len(gen)) if gen[j] == gen[j - 1]), None)
    lone = StopConditions(eol=gen[0], stop_on_double_eol=True)
    expected = free if pair is None or gen[pair] != gen[0] else free[:5 + pair + 1]
    assert _generate(model, PROMPTS[:1], stops=lone).tokens[0] == expected


def test_a_stopped_row_does_not_stop_the_others():
    model = tiny_model()
    free = _generate(model, PROMPTS)
    stop = free.tokens[0][6]
    out = _generate(model, PROMPTS, stops=StopConditions(eod=stop))
    for i, row in enumerate(free.tokens):
        gen = row[len(PROMPTS[i]):]
        end = len(PROMPTS[i]) + (gen.index(stop) + 1 if stop in gen else len(gen))
        assert out.tokens[i] == row[:end]


def test_prevent_newline_after_colon():
    model = tiny_model()
    prompt = PROMPTS[0]
    chosen = _generate(model, [prompt], n=1).tokens[0][-1]
    stops = StopConditions(colon=prompt[-1], eol=chosen, prevent_newline_after_colon=True,
                           stop_on_eod=False)
    assert _generate(model, [prompt], n=1, stops=stops).tokens[0][-1] != chosen


def test_on_step_reports_and_stops():
    model = tiny_model()
    seen = []

    def on_step(report):
        seen.append((report.rows, report.tokens))
        return [len(seen) >= 3] * len(PROMPTS)

    out = _generate(model, PROMPTS, on_step=on_step)
    free = _generate(model, PROMPTS)
    assert len(seen) == 3 and seen[0][0] == [2]  # only the 1-token prompt has started
    assert out.tokens[2] == free.tokens[2][:1 + 3]


def test_seeded_sampling_and_top_p_decay():
    model = tiny_model()
    sampled = [_generate(model, PROMPTS, sampling=SamplingOptions(top_p=0.9, seed=s)).tokens
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]
    assert decay_top_p(0.9, 0.5, 0.3) == 0.45 and decay_top_p(0.45, 0.5, 0.3) == 0.3
    assert decay_top_p(0.9, 0.0, 0.3) == 0.9 and decay_top_p(0.0, 0.5, 0.3) == 0.0


def test_vocab_padding_never_sampled():
    model = tiny_model()
    out = _generate(model, PROMPTS, sampling=SamplingOptions(temperature=50.0, seed=3),
                    vocab_size=257)
    assert max(max(t) for t in out.tokens) < 257


def _tp_equivalence(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp2 = tiny_model(ps.get_tensor_model_parallel_group(), attention_backend="unfused")
    tp1 = tiny_model(None, attention_backend="unfused")
    group = comm.world_group()
    results = []
    for model in (tp2, tp1):
        results.append([_generate(model, PROMPTS, mp_group=group if model is tp2 else None,
                                  use_kv_cache=cache) for cache in (True, False)])
    sampled = _generate(tp2, PROMPTS, mp_group=group,
                        sampling=SamplingOptions(top_k=5, seed=11 + rank))
    return results, sampled.tokens


def _llama_tp_equivalence(rank, world_size):
    del rank, world_size
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    out = []
    for extras in LLAMA_EXTRAS[1:]:
        tp2 = _llama(ps.get_tensor_model_parallel_group(), **extras)
        out.append([_generate(tp2, PROMPTS, mp_group=comm.world_group(), use_kv_cache=cache)
                    for cache in (True, False)])
    return out


def test_llama_qk_layernorm_tp2_equals_tp1_with_and_without_cache():
    """Each TP rank holds one key/value group and normalizes its own heads' q/k."""
    for rank_out in run_distributed(2, _llama_tp_equivalence):
        for extras, (cached, recomputed) in zip(LLAMA_EXTRAS[1:], rank_out):
            tp1 = _generate(_llama(**extras), PROMPTS)
            _assert_same(cached, tp1)
            _assert_same(recomputed, tp1)


def test_tp2_equals_tp1_with_and_without_cache():
    out = run_distributed(2, _tp_equivalence)
    for (tp2, tp1), _ in out:
        _assert_same(tp2[0], tp2[1])
        _assert_same(tp2[0], tp1[0])
    # Different seeds per rank, yet one answer: rank 0's tokens are broadcast each step.
    assert out[0][1] == out[1][1]


def _pp_equivalence(rank, world_size, tp):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=2)
    tp_group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    stage = tiny_stage(tp_group, ps.get_pipeline_model_parallel_rank(), 2,
                       attention_backend="unfused")
    groups = dict(mp_group=comm.world_group(), pp_group=ps.get_pipeline_model_parallel_group())
    out = [_generate(stage, PROMPTS, use_kv_cache=cache, top_logprobs=2, **groups)
           for cache in (True, False)]
    out.append(_generate(stage, PROMPTS, n=0, **groups))
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_stages_equal_one_process(tp):
    """PP=2 (and TP=2 x PP=2): every rank gets the one-process tokens and log-probs."""
    reference = tiny_model(attention_backend="unfused")
    full = _generate(reference, PROMPTS, top_logprobs=2)
    scored = _generate(reference, PROMPTS, n=0)
    for cached, recomputed, score in run_distributed(2 * tp, _pp_equivalence, tp):
        _assert_same(cached, full)
        _assert_same(recomputed, full)
        _assert_same(score, scored)
        assert cached.top_logprobs[0][3][0] == full.top_logprobs[0][3][0]


def test_sampling_leaves_the_logits_alone():
    """The log-probs are the model's over the whole (padded) vocabulary, as Megatron's, whether
    or not sampling masks the padded ids."""
    model = tiny_model()
    masked = _generate(model, PROMPTS, vocab_size=257)
    plain = _generate(model, PROMPTS)
    assert masked.tokens == plain.tokens and masked.logprobs == plain.logprobs
