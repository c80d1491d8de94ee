"""Megatron-LM's fused kernels as compiled torch extensions (built by ``setup.py`` at install).

* ``megatron.fused_kernels._cpu``: C++ (``csrc/cpu/``), torch's OpenMP thread pool over rows,
  vectorised inner loops; built wherever torch is importable at install time.
* ``megatron.fused_kernels._cuda``: CUDA (``csrc/cuda/``; the kernels themselves in
  ``fused_kernels.cuh``, which needs only CUDA); built only with a CUDA torch and CUDA_HOME.

Both export ``scaled_softmax_forward``, ``scaled_masked_softmax_forward``,
``scaled_upper_triang_masked_softmax_forward``, ``softmax_backward``,
``scaled_upper_triang_masked_softmax_backward``, ``layer_norm_forward``,
``layer_norm_backward``, ``rms_norm_forward`` and ``rms_norm_backward``; the CPU one also
``cross_entropy_stats`` and ``cross_entropy_backward`` (the fused vocab-parallel loss of
``megatron/core/fusions/fused_cross_entropy.py``). This package holds no Python code on
purpose: the model library loads the extensions, with the PyTorch fallback and its log line, in
:mod:`megatron.core.fusions.kernels`.
"""
