"""Mixture of experts as Megatron-Core builds it: router, token dispatch, experts."""
