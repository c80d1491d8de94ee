"""Fused operations of the transformer, each with its PyTorch reference path.

* :mod:`.fused_softmax`: Megatron's scale-mask-softmax kernels (unfused attention path).
* :mod:`.fused_layer_norm`: layer norm with the fused forward/backward kernels.
* :mod:`.fused_bias_gelu`: bias + tanh GeLU, the C++ kernel on CPU, TorchScript elsewhere.
* :mod:`.fused_bias_dropout`: TorchScript-fused bias + dropout + residual add.
* :mod:`.fused_cross_entropy`: the vocab-parallel LM loss in one read of the logits (C++ on CPU,
  ``torch.compile`` on CUDA); ``tensor_parallel.vocab_parallel_cross_entropy`` chooses it.
* :mod:`.fused_linear_few_rows`: ``F.linear`` for the few rows of a decoding step (C++ on CPU).
* :mod:`.kernels`: loads the compiled extensions of ``megatron.fused_kernels`` or reports (once,
  on rank 0) that the PyTorch path runs instead.
"""
