"""Tensor model parallelism: communication operators, parallel layers, vocab-parallel cross
entropy and the model-parallel RNG (Megatron-LM paper, section 3 and appendix B.2)."""

from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                  VocabParallelEmbedding, init_method_normal,
                                                  scaled_init_method_normal)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region)
from megatron.core.tensor_parallel.random import (checkpoint, get_rng_tracker,
                                                  model_parallel_manual_seed)
from megatron.core.tensor_parallel.utils import (param_is_not_tensor_parallel_duplicate,
                                                 set_defaults_if_not_set)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "checkpoint",
    "copy_to_tensor_model_parallel_region", "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "get_rng_tracker", "init_method_normal", "model_parallel_manual_seed",
    "param_is_not_tensor_parallel_duplicate", "reduce_from_tensor_model_parallel_region",
    "scaled_init_method_normal", "scatter_to_tensor_model_parallel_region",
    "set_defaults_if_not_set", "vocab_parallel_cross_entropy",
]
