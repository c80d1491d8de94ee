"""Zero-shot GPT evaluation: WikiText-103 perplexity and LAMBADA accuracy (Megatron-LM's
``tasks/zeroshot_gpt``)."""
