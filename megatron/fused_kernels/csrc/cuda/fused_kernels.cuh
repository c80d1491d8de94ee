// CUDA kernels of Megatron-LM's fused softmaxes, layer norm and RMS norm.
//
// This header depends on CUDA only (no torch), so `nvcc` alone compile-checks it
// (tests/fused_kernels/test_nvcc_compile.py instantiates every dtype). fused_kernels_cuda.cu
// binds the launchers to torch tensors.
//
// Types: T is float, __half or __nv_bfloat16; everything is computed and accumulated in fp32.
// Softmax semantics are Megatron's: scores are scaled, masked entries become -10000, and a row
// whose every entry is masked writes zeros. One thread block handles one row; rows of any
// length are processed in strided loops (no shared-memory copy of the row, so no length limit).

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdint.h>

namespace megatron_fused {

constexpr int kThreads = 256;
constexpr float kMaskedScore = -10000.0f;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Reduce `value` over the block (blockDim.x a multiple of 32, at most 1024); every thread gets
// the result. `scratch` holds 32 floats of shared memory.
template <typename Op>
__device__ float block_reduce(float value, Op op, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int offset = 16; offset > 0; offset /= 2) {
    value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  const int warps = blockDim.x / 32;
  value = scratch[0];
  for (int w = 1; w < warps; ++w) value = op(value, scratch[w]);
  return value;
}

// Row `blockIdx.x` of a [rows, n] softmax. `mask` (null = none) is the row's mask
// (nonzero = masked); entries at or after `valid` are masked by position (causal).
template <typename T>
__device__ void softmax_row(const T* x, const uint8_t* mask, int64_t valid, int64_t n,
                            float scale, T* y) {
  __shared__ float scratch[32];
  float local_max = -INFINITY;
  int unmasked = 0;
  for (int64_t i = threadIdx.x; i < valid; i += blockDim.x) {
    const bool keep = mask == nullptr || mask[i] == 0;
    local_max = fmaxf(local_max, keep ? to_float(x[i]) * scale : kMaskedScore);
    unmasked += keep ? 1 : 0;
  }
  const float row_max = block_reduce(local_max, MaxOp(), scratch);
  const float any_unmasked = block_reduce(static_cast<float>(unmasked), MaxOp(), scratch);
  float local_sum = 0.0f;
  for (int64_t i = threadIdx.x; i < valid; i += blockDim.x) {
    const bool keep = mask == nullptr || mask[i] == 0;
    local_sum += __expf((keep ? to_float(x[i]) * scale : kMaskedScore) - row_max);
  }
  const float inv_sum = 1.0f / block_reduce(local_sum, SumOp(), scratch);
  const bool zero_row = !(any_unmasked > 0.0f);  // Megatron: a fully masked row is zeros
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    float p = 0.0f;
    if (i < valid && !zero_row) {
      const bool keep = mask == nullptr || mask[i] == 0;
      p = __expf((keep ? to_float(x[i]) * scale : kMaskedScore) - row_max) * inv_sum;
    }
    y[i] = from_float<T>(p);
  }
}

// scaled_softmax: [rows, n], no mask.
template <typename T>
__global__ void scaled_softmax_kernel(const T* x, T* y, int64_t n, float scale) {
  const int64_t row = blockIdx.x;
  softmax_row<T>(x + row * n, nullptr, n, n, scale, y + row * n);
}

// scaled_masked_softmax: [b, heads, sq, sk], mask [mask_batches (1 or b), 1, sq, sk].
template <typename T>
__global__ void scaled_masked_softmax_kernel(const T* x, const uint8_t* mask, T* y, int64_t heads,
                                             int64_t sq, int64_t sk, int64_t mask_batches,
                                             float scale) {
  const int64_t row = blockIdx.x;
  const int64_t batch = row / (heads * sq), query = row % sq;
  const uint8_t* row_mask = mask + ((mask_batches == 1 ? 0 : batch) * sq + query) * sk;
  softmax_row<T>(x + row * sk, row_mask, sk, sk, scale, y + row * sk);
}

// scaled_upper_triang_masked_softmax: [attn_batches, sq, sk]; query q sees keys <= q + sk - sq.
template <typename T>
__global__ void scaled_upper_triang_softmax_kernel(const T* x, T* y, int64_t sq, int64_t sk,
                                                   float scale) {
  const int64_t row = blockIdx.x;
  const int64_t valid = row % sq + 1 + (sk - sq);
  softmax_row<T>(x + row * sk, nullptr, valid, sk, scale, y + row * sk);
}

// dx = scale * y * (dy - sum(dy * y)), row by row. `sq` > 0: causal rows, whose entries after
// r % sq + 1 + n - sq are zeros in y (and dx) and are not read.
template <typename T>
__global__ void softmax_backward_kernel(const T* dy, const T* y, T* dx, int64_t n, float scale,
                                        int64_t sq) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int64_t valid = sq > 0 ? row % sq + 1 + (n - sq) : n;
  dy += row * n;
  y += row * n;
  dx += row * n;
  float local = 0.0f;
  for (int64_t i = threadIdx.x; i < valid; i += blockDim.x) {
    local += to_float(dy[i]) * to_float(y[i]);
  }
  const float dot = block_reduce(local, SumOp(), scratch);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    dx[i] = i < valid ? from_float<T>(scale * to_float(y[i]) * (to_float(dy[i]) - dot))
                      : from_float<T>(0.0f);
  }
}

// Layer norm forward, one row per block: mean, then the variance of the centred row.
template <typename T>
__global__ void layer_norm_forward_kernel(const T* x, const T* weight, const T* bias, T* y,
                                          float* mean, float* invvar, int64_t h, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  x += row * h;
  y += row * h;
  float local = 0.0f;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) local += to_float(x[i]);
  const float mu = block_reduce(local, SumOp(), scratch) / static_cast<float>(h);
  local = 0.0f;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    const float d = to_float(x[i]) - mu;
    local += d * d;
  }
  const float var = block_reduce(local, SumOp(), scratch) / static_cast<float>(h);
  const float rstd = rsqrtf(var + eps);
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    y[i] = from_float<T>((to_float(x[i]) - mu) * rstd * to_float(weight[i]) + to_float(bias[i]));
  }
  if (threadIdx.x == 0) {
    mean[row] = mu;
    invvar[row] = rstd;
  }
}

// Layer norm input gradient, one row per block.
template <typename T>
__global__ void layer_norm_grad_input_kernel(const T* dy, const T* x, const float* mean,
                                             const float* invvar, const T* weight, T* dx,
                                             int64_t h) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  dy += row * h;
  x += row * h;
  dx += row * h;
  const float mu = mean[row], rstd = invvar[row];
  float sum_g = 0.0f, sum_g_xhat = 0.0f;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    const float g = to_float(dy[i]) * to_float(weight[i]);
    sum_g += g;
    sum_g_xhat += g * (to_float(x[i]) - mu) * rstd;
  }
  const float mean_g = block_reduce(sum_g, SumOp(), scratch) / static_cast<float>(h);
  const float mean_g_xhat = block_reduce(sum_g_xhat, SumOp(), scratch) / static_cast<float>(h);
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    const float xhat = (to_float(x[i]) - mu) * rstd;
    const float g = to_float(dy[i]) * to_float(weight[i]);
    dx[i] = from_float<T>(rstd * (g - mean_g - xhat * mean_g_xhat));
  }
}

// Layer norm weight and bias gradients: one thread per column, rows summed in order (coalesced
// across the threads of a warp, deterministic).
template <typename T>
__global__ void layer_norm_grad_weight_bias_kernel(const T* dy, const T* x, const float* mean,
                                                   const float* invvar, float* dweight,
                                                   float* dbias, int64_t rows, int64_t h) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= h) return;
  float dw = 0.0f, db = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float d = to_float(dy[r * h + col]);
    dw += d * (to_float(x[r * h + col]) - mean[r]) * invvar[r];
    db += d;
  }
  dweight[col] = dw;
  dbias[col] = db;
}

// RMS norm forward, one row per block, with Megatron's roundings: x * rstd in fp32, rounded to
// T, then times the weight (the CPU kernel's and Megatron's PyTorch RMSNorm's order).
template <typename T>
__global__ void rms_norm_forward_kernel(const T* x, const T* weight, T* y, float* invrms,
                                        int64_t h, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  x += row * h;
  y += row * h;
  float local = 0.0f;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    const float v = to_float(x[i]);
    local += v * v;
  }
  const float rstd = rsqrtf(block_reduce(local, SumOp(), scratch) / static_cast<float>(h) + eps);
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    const float normed = to_float(from_float<T>(to_float(x[i]) * rstd));
    y[i] = from_float<T>(normed * to_float(weight[i]));
  }
  if (threadIdx.x == 0) invrms[row] = rstd;
}

// RMS norm input gradient, one row per block: dx = rstd * (g - n * mean(g * n)), g = dy * w,
// n = x * rstd.
template <typename T>
__global__ void rms_norm_grad_input_kernel(const T* dy, const T* x, const float* invrms,
                                           const T* weight, T* dx, int64_t h) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  dy += row * h;
  x += row * h;
  dx += row * h;
  const float rstd = invrms[row];
  float local = 0.0f;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    local += to_float(dy[i]) * to_float(weight[i]) * to_float(x[i]) * rstd;
  }
  const float mean_g_n = block_reduce(local, SumOp(), scratch) / static_cast<float>(h);
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    const float g = to_float(dy[i]) * to_float(weight[i]);
    dx[i] = from_float<T>(rstd * (g - to_float(x[i]) * rstd * mean_g_n));
  }
}

// RMS norm weight gradient, partial sums: block (kColumns, kRowLanes) covers kColumns columns
// of the rows of chunk blockIdx.y (coalesced along a row); the lanes are added in order, so
// partial[chunk, col] (fp32) is deterministic; the caller sums the chunks.
constexpr int kColumns = 32;
constexpr int kRowLanes = 8;
constexpr int64_t kMaxWeightGradChunks = 128;

__host__ __device__ inline int64_t weight_grad_chunks(int64_t rows) {
  return rows < 1 ? 1 : (rows < kMaxWeightGradChunks ? rows : kMaxWeightGradChunks);
}

template <typename T>
__global__ void rms_norm_grad_weight_kernel(const T* dy, const T* x, const float* invrms,
                                            float* partial, int64_t rows, int64_t h) {
  __shared__ float lanes[kRowLanes][kColumns + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColumns + threadIdx.x;
  const int64_t chunks = gridDim.y;
  const int64_t begin = rows * blockIdx.y / chunks, end = rows * (blockIdx.y + 1) / chunks;
  float acc = 0.0f;
  if (col < h) {
    for (int64_t r = begin + threadIdx.y; r < end; r += kRowLanes) {
      const float normed = to_float(from_float<T>(to_float(x[r * h + col]) * invrms[r]));
      acc += to_float(dy[r * h + col]) * normed;
    }
  }
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < h) {
    float sum = 0.0f;
    for (int lane = 0; lane < kRowLanes; ++lane) sum += lanes[lane][threadIdx.x];
    partial[blockIdx.y * h + col] = sum;
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers (host side, CUDA runtime only)
// ---------------------------------------------------------------------------------------------

template <typename T>
void launch_scaled_softmax(const T* x, T* y, int64_t rows, int64_t n, float scale,
                           cudaStream_t stream) {
  if (rows == 0) return;
  scaled_softmax_kernel<T><<<rows, kThreads, 0, stream>>>(x, y, n, scale);
}

template <typename T>
void launch_scaled_masked_softmax(const T* x, const uint8_t* mask, T* y, int64_t b,
                                  int64_t heads, int64_t sq, int64_t sk, int64_t mask_batches,
                                  float scale, cudaStream_t stream) {
  const int64_t rows = b * heads * sq;
  if (rows == 0) return;
  scaled_masked_softmax_kernel<T><<<rows, kThreads, 0, stream>>>(x, mask, y, heads, sq, sk,
                                                                 mask_batches, scale);
}

template <typename T>
void launch_scaled_upper_triang_softmax(const T* x, T* y, int64_t attn_batches, int64_t sq,
                                        int64_t sk, float scale, cudaStream_t stream) {
  const int64_t rows = attn_batches * sq;
  if (rows == 0) return;
  scaled_upper_triang_softmax_kernel<T><<<rows, kThreads, 0, stream>>>(x, y, sq, sk, scale);
}

// `causal_sq` > 0: the causal kernel's backward (rows are [.., sq, n] blocks).
template <typename T>
void launch_softmax_backward(const T* dy, const T* y, T* dx, int64_t rows, int64_t n,
                             float scale, int64_t causal_sq, cudaStream_t stream) {
  if (rows == 0) return;
  softmax_backward_kernel<T><<<rows, kThreads, 0, stream>>>(dy, y, dx, n, scale, causal_sq);
}

template <typename T>
void launch_layer_norm_forward(const T* x, const T* weight, const T* bias, T* y, float* mean,
                               float* invvar, int64_t rows, int64_t h, float eps,
                               cudaStream_t stream) {
  if (rows == 0) return;
  layer_norm_forward_kernel<T><<<rows, kThreads, 0, stream>>>(x, weight, bias, y, mean, invvar,
                                                             h, eps);
}

template <typename T>
void launch_layer_norm_backward(const T* dy, const T* x, const float* mean, const float* invvar,
                                const T* weight, T* dx, float* dweight, float* dbias,
                                int64_t rows, int64_t h, cudaStream_t stream) {
  if (rows > 0) {
    layer_norm_grad_input_kernel<T><<<rows, kThreads, 0, stream>>>(dy, x, mean, invvar, weight,
                                                                  dx, h);
  }
  const int64_t blocks = (h + kThreads - 1) / kThreads;
  layer_norm_grad_weight_bias_kernel<T><<<blocks, kThreads, 0, stream>>>(dy, x, mean, invvar,
                                                                        dweight, dbias, rows, h);
}

template <typename T>
void launch_rms_norm_forward(const T* x, const T* weight, T* y, float* invrms, int64_t rows,
                             int64_t h, float eps, cudaStream_t stream) {
  if (rows == 0) return;
  rms_norm_forward_kernel<T><<<rows, kThreads, 0, stream>>>(x, weight, y, invrms, h, eps);
}

// `dweight_partial`: weight_grad_chunks(rows) x h floats, summed over the chunks by the caller.
template <typename T>
void launch_rms_norm_backward(const T* dy, const T* x, const float* invrms, const T* weight,
                              T* dx, float* dweight_partial, int64_t rows, int64_t h,
                              cudaStream_t stream) {
  if (rows > 0) {
    rms_norm_grad_input_kernel<T><<<rows, kThreads, 0, stream>>>(dy, x, invrms, weight, dx, h);
  }
  const dim3 grid(static_cast<unsigned>((h + kColumns - 1) / kColumns),
                  static_cast<unsigned>(weight_grad_chunks(rows)));
  rms_norm_grad_weight_kernel<T><<<grid, dim3(kColumns, kRowLanes), 0, stream>>>(
      dy, x, invrms, dweight_partial, rows, h);
}

}  // namespace megatron_fused
