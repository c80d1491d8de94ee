"""Benchmarks (run as scripts: ``python bench/<name>.py``) and the plain baselines they compare
against; tests import the baselines that double as references (``bench.reference_gpt2``)."""
