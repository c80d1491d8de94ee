"""The model-parallel library: parallel state, tensor/pipeline parallelism, optimizers, models."""
