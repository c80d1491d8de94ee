// CPU implementations of Megatron-LM's fused kernels, bound to Python with pybind11 through
// torch's extension API (module megatron.fused_kernels._cpu).
//
// Every kernel reads fp32/fp16/bf16, computes and accumulates in fp32, and writes the input's
// dtype. Rows are spread over torch's intra-op thread pool (OpenMP in the CPU wheels) with
// at::parallel_for, so torch.set_num_threads governs them; the per-row inner loops are plain
// float loops over contiguous memory that the compiler vectorises (`#pragma omp simd`).
//
// Softmax semantics follow Megatron's CUDA kernels (megatron/fused_kernels/scaled_*softmax.h):
// masked scores are set to -10000 after scaling, and a row whose every score is masked outputs
// zeros (the unfused PyTorch path gives such a row a uniform distribution instead).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr float kMaskedScore = -10000.0f;

// exp(x) for float, branch-free so that loops calling it vectorise. Cephes' expf: x = n ln2 + r,
// |r| <= ln2/2, a degree-6 polynomial for e^r, 2^n built in the exponent bits. Error <= 2 ulp
// over the normal range; inputs below -87.3 (e^x subnormal) return 0, as the masked -10000
// scores must.
inline float exp_approx(float x) {
  const float clamped = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.3f ? 0.0f : p * scale;
}

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

// ---------------------------------------------------------------------------------------------
// Softmax
// ---------------------------------------------------------------------------------------------

// softmax(scale * x) over the first `valid` entries of a row of `n`, zeros after them. `mask`
// (may be null) marks masked entries (-10000). `buf` is fp32 scratch of n floats.
template <typename T>
void softmax_row(const T* x, const uint8_t* mask, int64_t valid, int64_t n, float scale, T* y,
                 float* buf) {
  float max_value = -INFINITY;
  bool any_unmasked = valid > 0;
  if (mask != nullptr) {
    int64_t unmasked = 0;
#pragma omp simd reduction(max : max_value) reduction(+ : unmasked)
    for (int64_t i = 0; i < valid; ++i) {
      const bool keep = mask[i] == 0;
      buf[i] = keep ? to_float(x[i]) * scale : kMaskedScore;
      max_value = std::max(max_value, buf[i]);
      unmasked += keep ? 1 : 0;
    }
    any_unmasked = unmasked > 0;
  } else {
#pragma omp simd reduction(max : max_value)
    for (int64_t i = 0; i < valid; ++i) {
      buf[i] = to_float(x[i]) * scale;
      max_value = std::max(max_value, buf[i]);
    }
  }
  if (!any_unmasked) {  // Megatron's kernels write zeros for a fully masked row.
    for (int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(0.0f);
    return;
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < valid; ++i) {
    buf[i] = exp_approx(buf[i] - max_value);
    sum += buf[i];
  }
  const float inv_sum = 1.0f / sum;
#pragma omp simd
  for (int64_t i = 0; i < valid; ++i) y[i] = static_cast<T>(buf[i] * inv_sum);
  for (int64_t i = valid; i < n; ++i) y[i] = static_cast<T>(0.0f);
}

// Rows of the [rows, n] view of `input`; `row_mask(r)` gives row r's mask pointer (or null),
// `row_valid(r)` its number of leading unmasked-by-position entries.
template <typename T, typename MaskFn, typename ValidFn>
void softmax_rows(const at::Tensor& input, at::Tensor& output, float scale, MaskFn row_mask,
                  ValidFn row_valid) {
  const int64_t n = input.size(-1);
  const int64_t rows = input.numel() / std::max<int64_t>(n, 1);
  const T* in = input.data_ptr<T>();
  T* out = output.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t r = begin; r < end; ++r) {
      softmax_row<T>(in + r * n, row_mask(r), row_valid(r), n, scale, out + r * n, buf.data());
    }
  });
}

void check_softmax_input(const at::Tensor& input, int64_t dims, const char* name) {
  TORCH_CHECK(input.device().is_cpu(), name, ": expected a CPU tensor");
  TORCH_CHECK(input.dim() == dims, name, ": expected a ", dims, "-D tensor, got ",
              input.dim(), "-D");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kHalf ||
                  input.scalar_type() == at::kBFloat16,
              name, ": dtype must be float32, float16 or bfloat16");
}

// [b, np, sq, sk] -> softmax(scale * x) over sk.
at::Tensor scaled_softmax_forward(const at::Tensor& input_, double scale) {
  check_softmax_input(input_, 4, "scaled_softmax_forward");
  const at::Tensor input = input_.contiguous();
  at::Tensor output = at::empty_like(input);
  const int64_t sk = input.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "scaled_softmax",
                                  [&] {
    softmax_rows<scalar_t>(input, output, static_cast<float>(scale),
                           [](int64_t) -> const uint8_t* { return nullptr; },
                           [sk](int64_t) { return sk; });
  });
  return output;
}

// [b, np, sq, sk] with a boolean mask [b or 1, 1, sq, sk] (True = masked out).
at::Tensor scaled_masked_softmax_forward(const at::Tensor& input_, const at::Tensor& mask_,
                                         double scale) {
  check_softmax_input(input_, 4, "scaled_masked_softmax_forward");
  TORCH_CHECK(mask_.dim() == 4 && mask_.size(1) == 1 && mask_.size(2) == input_.size(2) &&
                  mask_.size(3) == input_.size(3) &&
                  (mask_.size(0) == 1 || mask_.size(0) == input_.size(0)),
              "scaled_masked_softmax_forward: mask must be [b or 1, 1, sq, sk]");
  const at::Tensor input = input_.contiguous();
  const at::Tensor mask = mask_.to(at::kByte).contiguous();  // bool and uint8 are both 1 byte
  at::Tensor output = at::empty_like(input);
  const int64_t heads = input.size(1), sq = input.size(2), sk = input.size(3);
  const int64_t mask_batches = mask.size(0);
  const uint8_t* mask_data = mask.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(),
                                  "scaled_masked_softmax", [&] {
    softmax_rows<scalar_t>(
        input, output, static_cast<float>(scale),
        [=](int64_t r) -> const uint8_t* {
          const int64_t batch = r / (heads * sq), query = r % sq;  // heads share the mask
          return mask_data + ((mask_batches == 1 ? 0 : batch) * sq + query) * sk;
        },
        [sk](int64_t) { return sk; });
  });
  return output;
}

// [attn_batches, sq, sk], causal: query i sees keys j <= i + (sk - sq) (sq == sk in training;
// the offset aligns the queries with the last keys as a KV cache does).
at::Tensor scaled_upper_triang_masked_softmax_forward(const at::Tensor& input_, double scale) {
  check_softmax_input(input_, 3, "scaled_upper_triang_masked_softmax_forward");
  TORCH_CHECK(input_.size(1) <= input_.size(2),
              "scaled_upper_triang_masked_softmax_forward: needs sq <= sk");
  const at::Tensor input = input_.contiguous();
  at::Tensor output = at::empty_like(input);
  const int64_t sq = input.size(1), sk = input.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(),
                                  "scaled_upper_triang_masked_softmax", [&] {
    softmax_rows<scalar_t>(input, output, static_cast<float>(scale),
                           [](int64_t) -> const uint8_t* { return nullptr; },
                           [=](int64_t r) { return r % sq + 1 + (sk - sq); });
  });
  return output;
}

// dx = scale * y * (dy - sum(dy * y)) row by row; the same for every softmax variant (masked
// entries have y == 0, so they get no gradient). (Loops with pragmas live in templates: a
// pragma cannot sit inside the AT_DISPATCH macro's argument.)
// `sq` > 0: causal rows (row r of each [sq, n] block has r % sq + 1 + n - sq live entries; the
// rest are exact zeros in y, hence in dx, and are not read).
template <typename T>
void softmax_backward_rows(const T* dy, const T* y, T* dx, int64_t rows, int64_t n, float s,
                           int64_t sq) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* dyr = dy + r * n;
      const T* yr = y + r * n;
      T* dxr = dx + r * n;
      const int64_t valid = sq > 0 ? r % sq + 1 + (n - sq) : n;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < valid; ++i) dot += to_float(dyr[i]) * to_float(yr[i]);
#pragma omp simd
      for (int64_t i = 0; i < valid; ++i) {
        dxr[i] = static_cast<T>(s * to_float(yr[i]) * (to_float(dyr[i]) - dot));
      }
      for (int64_t i = valid; i < n; ++i) dxr[i] = static_cast<T>(0.0f);
    }
  });
}

at::Tensor softmax_backward_impl(const at::Tensor& grad_output_, const at::Tensor& output_,
                                 double scale, bool causal) {
  TORCH_CHECK(grad_output_.sizes() == output_.sizes(), "softmax backward: shape mismatch");
  TORCH_CHECK(grad_output_.scalar_type() == output_.scalar_type(),
              "softmax backward: dtype mismatch");
  const at::Tensor grad_output = grad_output_.contiguous();
  const at::Tensor output = output_.contiguous();
  at::Tensor grad_input = at::empty_like(output);
  const int64_t n = output.size(-1);
  const int64_t rows = output.numel() / std::max<int64_t>(n, 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, output.scalar_type(),
                                  "softmax_backward", [&] {
    softmax_backward_rows<scalar_t>(grad_output.data_ptr<scalar_t>(), output.data_ptr<scalar_t>(),
                                    grad_input.data_ptr<scalar_t>(), rows, n,
                                    static_cast<float>(scale), causal ? output.size(-2) : 0);
  });
  return grad_input;
}

at::Tensor softmax_backward(const at::Tensor& grad_output, const at::Tensor& output,
                            double scale) {
  return softmax_backward_impl(grad_output, output, scale, false);
}

// The causal kernel's backward ([attn_batches, sq, sk]): only the live lower triangle.
at::Tensor scaled_upper_triang_masked_softmax_backward(const at::Tensor& grad_output,
                                                       const at::Tensor& output, double scale) {
  TORCH_CHECK(output.dim() == 3 && output.size(1) <= output.size(2),
              "scaled_upper_triang_masked_softmax_backward: expected [attn_batches, sq, sk]");
  return softmax_backward_impl(grad_output, output, scale, true);
}

// ---------------------------------------------------------------------------------------------
// Layer norm
// ---------------------------------------------------------------------------------------------

void check_layer_norm_input(const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias) {
  TORCH_CHECK(input.device().is_cpu(), "layer_norm: expected CPU tensors");
  const int64_t h = input.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h && bias.dim() == 1 && bias.size(0) == h,
              "layer_norm: weight and bias must be [", h, "]");
  TORCH_CHECK(weight.scalar_type() == input.scalar_type() &&
                  bias.scalar_type() == input.scalar_type(),
              "layer_norm: input, weight and bias must share one dtype");
}

template <typename T>
void layer_norm_forward_rows(const T* x, const T* w, const T* b, T* y, float* mean_out,
                             float* invvar_out, int64_t rows, int64_t h, float eps) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(h, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(h);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * h;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < h; ++i) {
        row[i] = to_float(xr[i]);
        sum += row[i];
      }
      const float mu = sum / static_cast<float>(h);
      // Two passes over the cached row: the variance of the centred values does not lose the
      // digits that E[x^2] - mean^2 cancels.
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < h; ++i) squares += (row[i] - mu) * (row[i] - mu);
      const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(h) + eps);
      T* yr = y + r * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) {
        yr[i] = static_cast<T>((row[i] - mu) * rstd * to_float(w[i]) + to_float(b[i]));
      }
      mean_out[r] = mu;
      invvar_out[r] = rstd;
    }
  });
}

// y = (x - mean) * invvar * weight + bias over the last dim; returns (y, mean, invvar), the
// statistics fp32 [rows] for the backward.
std::vector<at::Tensor> layer_norm_forward(const at::Tensor& input_, const at::Tensor& weight_,
                                           const at::Tensor& bias_, double eps) {
  check_layer_norm_input(input_, weight_, bias_);
  const at::Tensor input = input_.contiguous();
  const at::Tensor weight = weight_.contiguous(), bias = bias_.contiguous();
  const int64_t h = input.size(-1), rows = input.numel() / std::max<int64_t>(h, 1);
  at::Tensor output = at::empty_like(input);
  at::Tensor mean = at::empty({rows}, input.options().dtype(at::kFloat));
  at::Tensor invvar = at::empty({rows}, input.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(),
                                  "layer_norm_forward", [&] {
    layer_norm_forward_rows<scalar_t>(input.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                      bias.data_ptr<scalar_t>(), output.data_ptr<scalar_t>(),
                                      mean.data_ptr<float>(), invvar.data_ptr<float>(), rows, h,
                                      static_cast<float>(eps));
  });
  return {output, mean, invvar};
}

template <typename T>
void layer_norm_backward_chunks(const T* dy, const T* x, const float* mu, const float* rstd,
                                const T* w, T* dx, float* dw_partial, int64_t rows, int64_t h,
                                int64_t chunks) {
  float* db_partial = dw_partial + chunks * h;
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    std::vector<float> xhat(h), g(h);
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      float* dw = dw_partial + c * h;
      float* db = db_partial + c * h;
      const int64_t row_begin = rows * c / chunks, row_end = rows * (c + 1) / chunks;
      for (int64_t r = row_begin; r < row_end; ++r) {
        const T* dyr = dy + r * h;
        const T* xr = x + r * h;
        const float m = mu[r], inv = rstd[r];
        float sum_g = 0.0f, sum_g_xhat = 0.0f;
#pragma omp simd reduction(+ : sum_g, sum_g_xhat)
        for (int64_t i = 0; i < h; ++i) {
          const float d = to_float(dyr[i]);
          xhat[i] = (to_float(xr[i]) - m) * inv;
          g[i] = d * to_float(w[i]);
          dw[i] += d * xhat[i];
          db[i] += d;
          sum_g += g[i];
          sum_g_xhat += g[i] * xhat[i];
        }
        const float mean_g = sum_g / static_cast<float>(h);
        const float mean_g_xhat = sum_g_xhat / static_cast<float>(h);
        T* dxr = dx + r * h;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) {
          dxr[i] = static_cast<T>(inv * (g[i] - mean_g - xhat[i] * mean_g_xhat));
        }
      }
    }
  });
}

// Input, weight and bias gradients. Weight/bias partial sums are kept per chunk of rows in fp32
// and added in chunk order, so the result does not depend on thread timing.
std::vector<at::Tensor> layer_norm_backward(const at::Tensor& grad_output_,
                                            const at::Tensor& input_, const at::Tensor& mean_,
                                            const at::Tensor& invvar_, const at::Tensor& weight_) {
  const at::Tensor grad_output = grad_output_.contiguous(), input = input_.contiguous();
  const at::Tensor mean = mean_.contiguous(), invvar = invvar_.contiguous();
  const at::Tensor weight = weight_.contiguous();
  TORCH_CHECK(grad_output.sizes() == input.sizes(), "layer_norm_backward: shape mismatch");
  const int64_t h = input.size(-1), rows = input.numel() / std::max<int64_t>(h, 1);
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(rows, 4 * at::get_num_threads()));
  at::Tensor grad_input = at::empty_like(input);
  at::Tensor partial = at::zeros({2, chunks, h}, input.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(),
                                  "layer_norm_backward", [&] {
    layer_norm_backward_chunks<scalar_t>(
        grad_output.data_ptr<scalar_t>(), input.data_ptr<scalar_t>(), mean.data_ptr<float>(),
        invvar.data_ptr<float>(), weight.data_ptr<scalar_t>(), grad_input.data_ptr<scalar_t>(),
        partial.data_ptr<float>(), rows, h, chunks);
  });
  at::Tensor sums = partial.sum(1);  // [2, h] in chunk order
  return {grad_input, sums[0].to(weight.scalar_type()), sums[1].to(weight.scalar_type())};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Megatron fused kernels, CPU (C++ with torch's OpenMP thread pool)";
  m.def("scaled_softmax_forward", &scaled_softmax_forward, "softmax(scale * x), [b, np, sq, sk]");
  m.def("scaled_masked_softmax_forward", &scaled_masked_softmax_forward,
        "softmax(mask(scale * x)), mask [b or 1, 1, sq, sk] True = masked");
  m.def("scaled_upper_triang_masked_softmax_forward", &scaled_upper_triang_masked_softmax_forward,
        "causal softmax(scale * x), [attn_batches, sq, sk]");
  m.def("softmax_backward", &softmax_backward, "gradient of the scaled softmaxes");
  m.def("scaled_upper_triang_masked_softmax_backward",
        &scaled_upper_triang_masked_softmax_backward,
        "gradient of the causal softmax, [attn_batches, sq, sk] (lower triangle only)");
  m.def("layer_norm_forward", &layer_norm_forward, "fused layer norm -> (y, mean, invvar)");
  m.def("layer_norm_backward", &layer_norm_backward,
        "fused layer norm backward -> (grad_input, grad_weight, grad_bias)");
}
