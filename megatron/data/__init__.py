"""Data pipeline: indexed datasets, the dataset builder with its base dataset and config, GPT
samples, BERT masked-LM samples, blending, samplers. Nothing here reads the CLI config (see
megatron/config/datasets.py)."""
