// Compile check of fused_kernels.cuh with nvcc alone (no torch): every launcher instantiated
// for every dtype. Built by tests/fused_kernels/test_nvcc_compile.py; never linked or run.

#include "fused_kernels.cuh"

namespace megatron_fused {

#define MEGATRON_INSTANTIATE(T)                                                                 \
  template void launch_scaled_softmax<T>(const T*, T*, int64_t, int64_t, float, cudaStream_t);  \
  template void launch_scaled_masked_softmax<T>(const T*, const uint8_t*, T*, int64_t, int64_t, \
                                                int64_t, int64_t, int64_t, float, cudaStream_t); \
  template void launch_scaled_upper_triang_softmax<T>(const T*, T*, int64_t, int64_t, int64_t,  \
                                                      float, cudaStream_t);                     \
  template void launch_softmax_backward<T>(const T*, const T*, T*, int64_t, int64_t, float,     \
                                           int64_t, cudaStream_t);                              \
  template void launch_layer_norm_forward<T>(const T*, const T*, const T*, T*, float*, float*,  \
                                             int64_t, int64_t, float, cudaStream_t);            \
  template void launch_layer_norm_backward<T>(const T*, const T*, const float*, const float*,   \
                                              const T*, T*, float*, float*, int64_t, int64_t,   \
                                              cudaStream_t);                                    \
  template void launch_rms_norm_forward<T>(const T*, const T*, T*, float*, int64_t, int64_t,    \
                                           float, cudaStream_t);                                \
  template void launch_rms_norm_backward<T>(const T*, const T*, const float*, const T*, T*,     \
                                            float*, int64_t, int64_t, cudaStream_t);

MEGATRON_INSTANTIATE(float)
MEGATRON_INSTANTIATE(__half)
MEGATRON_INSTANTIATE(__nv_bfloat16)

#undef MEGATRON_INSTANTIATE

}  // namespace megatron_fused
