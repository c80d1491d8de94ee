"""Data pipeline: indexed datasets, GPT sample indices, blending, samplers."""
