"""Fused operations of the transformer, each with its PyTorch reference path.

* :mod:`.fused_softmax`: Megatron's scale-mask-softmax kernels (unfused attention path).
* :mod:`.fused_layer_norm`: layer norm with the fused forward/backward kernels.
* :mod:`.fused_bias_gelu`: bias + tanh GeLU, the C++ kernel on CPU, TorchScript elsewhere.
* :mod:`.fused_bias_dropout`: TorchScript-fused bias + dropout + residual add.
* :mod:`.kernels`: loads the compiled extensions of ``megatron.fused_kernels`` or reports (once,
  on rank 0) that the PyTorch path runs instead.
"""
