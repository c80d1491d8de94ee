"""The text generation server: Megatron's ``PUT /api``, an OpenAI-style ``POST /v1/completions``
(streaming as server-sent events) and a web page, over a bounded one-at-a-time queue."""
