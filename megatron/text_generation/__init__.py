"""Autoregressive text generation from a (tensor-parallel) GPT model: a KV cache, batched prompts
of different lengths, Megatron's sampling and stop rules, log-probs, beam search, and the
request loop the server's ranks run (``server/`` holds the HTTP side)."""

from megatron.text_generation.api import (GenerationRequest, GenerationResult, follow_requests,
                                          lead_request, run_request, stop_followers)
from megatron.text_generation.beam_search import BeamHypotheses, beam_search
from megatron.text_generation.generation import (GenerationOutput, SamplingOptions,
                                                 StopConditions, check_generation_lengths,
                                                 generate_text, generate_tokens,
                                                 generate_tokens_and_logprobs)
from megatron.text_generation.sampling import check_sampling_options, decay_top_p, sample

__all__ = ["BeamHypotheses", "GenerationOutput", "GenerationRequest", "GenerationResult",
           "SamplingOptions", "StopConditions", "beam_search", "check_generation_lengths",
           "check_sampling_options", "decay_top_p", "follow_requests", "generate_text",
           "generate_tokens", "generate_tokens_and_logprobs", "lead_request", "run_request",
           "sample", "stop_followers"]
