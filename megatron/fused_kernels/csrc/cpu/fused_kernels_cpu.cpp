// CPU implementations of Megatron-LM's fused kernels (and of the bias + GeLU it fuses with
// TorchScript), bound to Python with pybind11 through torch's extension API (module
// megatron.fused_kernels._cpu).
//
// Every kernel reads fp32/fp16/bf16, computes and accumulates in fp32, and writes the input's
// dtype. Rows are spread over torch's intra-op thread pool (OpenMP in the CPU wheels) with
// at::parallel_for, so torch.set_num_threads governs them; the per-row work is in row_kernels.h
// (plain vectorisable fp32 loops; this file binds tensors to them).
//
// Softmax semantics follow Megatron's CUDA kernels (megatron/fused_kernels/scaled_*softmax.h):
// masked scores are set to -10000 after scaling, and a row whose every score is masked outputs
// zeros (the unfused PyTorch path gives such a row a uniform distribution instead).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "row_kernels.h"

namespace {

using megatron_cpu::Bf16Codec;
using megatron_cpu::FloatCodec;

// fp16 through c10's scalar conversion: CPUs rarely train in fp16, so it is kept simple.
struct HalfCodec {
  using storage = at::Half;
  static float to_float(at::Half v) { return static_cast<float>(v); }
  static at::Half from_float(float v) { return static_cast<at::Half>(v); }
  static void load(const at::Half* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
  }
};

// Calls fn(codec) with the codec of `dtype`; fn gets the storage type as `typename
// decltype(codec)::storage` and the data through `data<C>(tensor)`.
template <typename Fn>
void dispatch_codec(at::ScalarType dtype, const char* name, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(FloatCodec{}); break;
    case at::kBFloat16: fn(Bf16Codec{}); break;
    case at::kHalf: fn(HalfCodec{}); break;
    default: TORCH_CHECK(false, name, ": dtype must be float32, float16 or bfloat16");
  }
}

template <typename C>
typename C::storage* data(const at::Tensor& t) {
  return reinterpret_cast<typename C::storage*>(t.data_ptr());
}

// Rows per parallel task: about 32k elements, enough to amortise a task, few enough to balance.
int64_t grain_for(int64_t row_length) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_length, 1));
}

// Sums over rows (layer norm's weight and bias gradients, bias-GeLU's bias gradient) keep fp32
// partial sums per chunk of rows and add them in chunk order. The chunking depends on the row
// count only, never on the thread count, so the sums are the same bits run to run and for any
// number of threads.
constexpr int64_t kMaxRowChunks = 64;

int64_t row_chunks(int64_t rows) {
  return std::max<int64_t>(1, std::min(rows, kMaxRowChunks));
}

// fn(chunk, row_begin, row_end) for each of `chunks` consecutive row ranges, the chunks spread
// over torch's threads.
template <typename Fn>
void for_each_row_chunk(int64_t rows, int64_t chunks, const Fn& fn) {
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      fn(c, rows * c / chunks, rows * (c + 1) / chunks);
    }
  });
}

std::vector<float> to_float_vector(const at::Tensor& t) {
  const at::Tensor f = t.to(at::kFloat).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

// ---------------------------------------------------------------------------------------------
// Softmax
// ---------------------------------------------------------------------------------------------

// Rows of the [rows, n] view of `input`; `row_mask(r)` gives row r's mask pointer (or null),
// `row_valid(r)` its number of leading entries not masked by position (causal).
template <typename MaskFn, typename ValidFn>
at::Tensor softmax_rows(const at::Tensor& input, float scale, MaskFn row_mask,
                        ValidFn row_valid, const char* name) {
  at::Tensor output = at::empty_like(input);
  const int64_t n = input.size(-1);
  const int64_t rows = input.numel() / std::max<int64_t>(n, 1);
  dispatch_codec(input.scalar_type(), name, [&](auto codec) {
    using C = decltype(codec);
    const auto* in = data<C>(input);
    auto* out = data<C>(output);
    at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(n);
      for (int64_t r = begin; r < end; ++r) {
        megatron_cpu::softmax_forward_row<C>(in + r * n, row_mask(r), row_valid(r), n, scale,
                                             out + r * n, buf.data());
      }
    });
  });
  return output;
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
  const int64_t sk = input.size(3);
  return softmax_rows(input, static_cast<float>(scale),
                      [](int64_t) -> const uint8_t* { return nullptr; },
                      [sk](int64_t) { return sk; }, "scaled_softmax_forward");
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
  const int64_t heads = input.size(1), sq = input.size(2), sk = input.size(3);
  const int64_t mask_batches = mask.size(0);
  const uint8_t* mask_data = mask.data_ptr<uint8_t>();
  return softmax_rows(
      input, static_cast<float>(scale),
      [=](int64_t r) -> const uint8_t* {
        const int64_t batch = r / (heads * sq), query = r % sq;  // heads share the mask
        return mask_data + ((mask_batches == 1 ? 0 : batch) * sq + query) * sk;
      },
      [sk](int64_t) { return sk; }, "scaled_masked_softmax_forward");
}

// [attn_batches, sq, sk], causal: query i sees keys j <= i + (sk - sq) (sq == sk in training;
// the offset aligns the queries with the last keys as a KV cache does).
at::Tensor scaled_upper_triang_masked_softmax_forward(const at::Tensor& input_, double scale) {
  check_softmax_input(input_, 3, "scaled_upper_triang_masked_softmax_forward");
  TORCH_CHECK(input_.size(1) <= input_.size(2),
              "scaled_upper_triang_masked_softmax_forward: needs sq <= sk");
  const at::Tensor input = input_.contiguous();
  const int64_t sq = input.size(1), sk = input.size(2);
  return softmax_rows(input, static_cast<float>(scale),
                      [](int64_t) -> const uint8_t* { return nullptr; },
                      [=](int64_t r) { return r % sq + 1 + (sk - sq); },
                      "scaled_upper_triang_masked_softmax_forward");
}

// dx = scale * y * (dy - sum(dy * y)) row by row, the same for every softmax variant (masked
// entries have y == 0, so they get no gradient). `causal`: row r of each [sq, n] block has
// r % sq + 1 + n - sq live entries; the rest are exact zeros in y, hence in dx, and are not read.
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
  const int64_t sq = causal ? output.size(-2) : 0;
  const float s = static_cast<float>(scale);
  dispatch_codec(output.scalar_type(), "softmax_backward", [&](auto codec) {
    using C = decltype(codec);
    const auto* dy = data<C>(grad_output);
    const auto* y = data<C>(output);
    auto* dx = data<C>(grad_input);
    at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t valid = sq > 0 ? r % sq + 1 + (n - sq) : n;
        megatron_cpu::softmax_backward_row<C>(dy + r * n, y + r * n, valid, n, s, dx + r * n);
      }
    });
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

// y = (x - mean) * invvar * weight + bias over the last dim; returns (y, mean, invvar), the
// statistics fp32 [rows] for the backward.
std::vector<at::Tensor> layer_norm_forward(const at::Tensor& input_, const at::Tensor& weight,
                                           const at::Tensor& bias, double eps) {
  check_layer_norm_input(input_, weight, bias);
  const at::Tensor input = input_.contiguous();
  const int64_t h = input.size(-1), rows = input.numel() / std::max<int64_t>(h, 1);
  at::Tensor output = at::empty_like(input);
  at::Tensor mean = at::empty({rows}, input.options().dtype(at::kFloat));
  at::Tensor invvar = at::empty({rows}, input.options().dtype(at::kFloat));
  const std::vector<float> w = to_float_vector(weight), b = to_float_vector(bias);
  float* mean_data = mean.data_ptr<float>();
  float* invvar_data = invvar.data_ptr<float>();
  dispatch_codec(input.scalar_type(), "layer_norm_forward", [&](auto codec) {
    using C = decltype(codec);
    const auto* x = data<C>(input);
    auto* y = data<C>(output);
    at::parallel_for(0, rows, grain_for(h), [&](int64_t begin, int64_t end) {
      std::vector<float> row(h);
      for (int64_t r = begin; r < end; ++r) {
        megatron_cpu::layer_norm_forward_row<C>(x + r * h, w.data(), b.data(), h,
                                                static_cast<float>(eps), y + r * h, row.data(),
                                                mean_data + r, invvar_data + r);
      }
    });
  });
  return {output, mean, invvar};
}

// Input, weight and bias gradients; the weight and bias gradients are summed over row chunks
// (row_chunks: the same bits for any thread count).
std::vector<at::Tensor> layer_norm_backward(const at::Tensor& grad_output_,
                                            const at::Tensor& input_, const at::Tensor& mean_,
                                            const at::Tensor& invvar_, const at::Tensor& weight) {
  const at::Tensor grad_output = grad_output_.contiguous(), input = input_.contiguous();
  const at::Tensor mean = mean_.contiguous(), invvar = invvar_.contiguous();
  TORCH_CHECK(grad_output.sizes() == input.sizes(), "layer_norm_backward: shape mismatch");
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(),
              "layer_norm_backward: dtype mismatch");
  const int64_t h = input.size(-1), rows = input.numel() / std::max<int64_t>(h, 1);
  const int64_t chunks = row_chunks(rows);
  at::Tensor grad_input = at::empty_like(input);
  at::Tensor partial = at::zeros({2, chunks, h}, input.options().dtype(at::kFloat));
  const std::vector<float> w = to_float_vector(weight);
  const float* mu = mean.data_ptr<float>();
  const float* rstd = invvar.data_ptr<float>();
  float* dw_partial = partial.data_ptr<float>();
  float* db_partial = dw_partial + chunks * h;
  dispatch_codec(input.scalar_type(), "layer_norm_backward", [&](auto codec) {
    using C = decltype(codec);
    const auto* dy = data<C>(grad_output);
    const auto* x = data<C>(input);
    auto* dx = data<C>(grad_input);
    for_each_row_chunk(rows, chunks, [&](int64_t c, int64_t row_begin, int64_t row_end) {
      std::vector<float> xhat(h), g(h);
      for (int64_t r = row_begin; r < row_end; ++r) {
        megatron_cpu::layer_norm_backward_row<C>(dy + r * h, x + r * h, mu[r], rstd[r], w.data(),
                                                 h, dx + r * h, dw_partial + c * h,
                                                 db_partial + c * h, xhat.data(), g.data());
      }
    });
  });
  at::Tensor sums = partial.sum(1);  // [2, h] in chunk order
  return {grad_input, sums[0].to(weight.scalar_type()), sums[1].to(weight.scalar_type())};
}

// ---------------------------------------------------------------------------------------------
// RMS norm
// ---------------------------------------------------------------------------------------------

void check_rms_norm_input(const at::Tensor& input, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), name,
              ": expected CPU tensors");
  TORCH_CHECK(input.dim() >= 1, name, ": expected input [..., h]");
  const int64_t h = input.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h, name, ": weight must be [", h, "]");
  TORCH_CHECK(weight.scalar_type() == input.scalar_type(), name,
              ": input and weight must share one dtype");
}

// y = round(round(x * rstd) * weight) over the last dim (Megatron's RMSNorm; the inner rounding
// is to the input's dtype, the identity in fp32); returns (y, rstd), rstd fp32 [rows] for the
// backward.
std::vector<at::Tensor> rms_norm_forward(const at::Tensor& input_, const at::Tensor& weight,
                                         double eps) {
  check_rms_norm_input(input_, weight, "rms_norm_forward");
  const at::Tensor input = input_.contiguous();
  const int64_t h = input.size(-1), rows = input.numel() / std::max<int64_t>(h, 1);
  at::Tensor output = at::empty_like(input);
  at::Tensor rstd = at::empty({rows}, input.options().dtype(at::kFloat));
  const std::vector<float> w = to_float_vector(weight);
  float* rstd_data = rstd.data_ptr<float>();
  dispatch_codec(input.scalar_type(), "rms_norm_forward", [&](auto codec) {
    using C = decltype(codec);
    const auto* x = data<C>(input);
    auto* y = data<C>(output);
    at::parallel_for(0, rows, grain_for(h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        megatron_cpu::rms_norm_forward_row<C>(x + r * h, w.data(), h, static_cast<float>(eps),
                                              y + r * h, rstd_data + r);
      }
    });
  });
  return {output, rstd};
}

// (grad_input, grad_weight); the weight gradient summed over row chunks (row_chunks: the same
// bits for any thread count), rounded once to the weight's dtype.
std::vector<at::Tensor> rms_norm_backward(const at::Tensor& grad_output_,
                                          const at::Tensor& input_, const at::Tensor& rstd_,
                                          const at::Tensor& weight) {
  check_rms_norm_input(input_, weight, "rms_norm_backward");
  const at::Tensor grad_output = grad_output_.contiguous(), input = input_.contiguous();
  const at::Tensor rstd = rstd_.to(at::kFloat).contiguous();
  TORCH_CHECK(grad_output.sizes() == input.sizes() &&
                  grad_output.scalar_type() == input.scalar_type(),
              "rms_norm_backward: grad_output must have the input's shape and dtype");
  const int64_t h = input.size(-1), rows = input.numel() / std::max<int64_t>(h, 1);
  TORCH_CHECK(rstd.numel() == rows, "rms_norm_backward: rstd must have one entry per row");
  const int64_t chunks = row_chunks(rows);
  at::Tensor grad_input = at::empty_like(input);
  at::Tensor partial = at::zeros({chunks, h}, input.options().dtype(at::kFloat));
  const std::vector<float> w = to_float_vector(weight);
  const float* rs = rstd.data_ptr<float>();
  float* dw_partial = partial.data_ptr<float>();
  dispatch_codec(input.scalar_type(), "rms_norm_backward", [&](auto codec) {
    using C = decltype(codec);
    const auto* dy = data<C>(grad_output);
    const auto* x = data<C>(input);
    auto* dx = data<C>(grad_input);
    for_each_row_chunk(rows, chunks, [&](int64_t c, int64_t row_begin, int64_t row_end) {
      for (int64_t r = row_begin; r < row_end; ++r) {
        megatron_cpu::rms_norm_backward_row<C>(dy + r * h, x + r * h, rs[r], w.data(), h,
                                               dx + r * h, dw_partial + c * h);
      }
    });
  });
  return {grad_input, partial.sum(0).to(weight.scalar_type())};
}

// ---------------------------------------------------------------------------------------------
// Cross entropy (the vocabulary-parallel loss's per-rank passes; the all-reduces stay in
// Python, in megatron/core/fusions/fused_cross_entropy.py)
// ---------------------------------------------------------------------------------------------

void check_logits(const at::Tensor& logits, const char* name) {
  TORCH_CHECK(logits.device().is_cpu(), name, ": expected a CPU tensor");
  TORCH_CHECK(logits.dim() >= 1 && logits.is_contiguous(), name,
              ": expected contiguous logits [..., V/p]");
}

// One read of the logits [..., V/p]: per row the max, sum(exp(l - max)) and sum(l), fp32 [...].
std::vector<at::Tensor> cross_entropy_stats(const at::Tensor& logits) {
  check_logits(logits, "cross_entropy_stats");
  const int64_t n = logits.size(-1), rows = logits.numel() / std::max<int64_t>(n, 1);
  const auto stat_shape = logits.sizes().slice(0, logits.dim() - 1);
  at::Tensor max_out = at::empty(stat_shape, logits.options().dtype(at::kFloat));
  at::Tensor sum_exp_out = at::empty_like(max_out), sum_out = at::empty_like(max_out);
  float* m = max_out.data_ptr<float>();
  float* se = sum_exp_out.data_ptr<float>();
  float* s = sum_out.data_ptr<float>();
  dispatch_codec(logits.scalar_type(), "cross_entropy_stats", [&](auto codec) {
    using C = decltype(codec);
    const auto* l = data<C>(logits);
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(megatron_cpu::kCrossEntropyBlock);
      for (int64_t r = begin; r < end; ++r) {
        megatron_cpu::cross_entropy_row_stats<C>(l + r * n, n, m + r, se + r, s + r,
                                                 buf.data());
      }
    });
  });
  return {max_out, sum_exp_out, sum_out};
}

// d loss / d logits = (softmax - on_target * onehot(target) - uniform) * grad_loss, with the
// softmax rebuilt from the saved row max and sum of exponentials (global over the TP group).
// `local_target` [...] int64: the target's column on this rank, or -1 where another rank holds
// it. Written into `logits` itself when `inplace` (one read and one write of the logits).
at::Tensor cross_entropy_backward(at::Tensor logits, const at::Tensor& max_,
                                  const at::Tensor& sum_exp_,
                                  const at::Tensor& local_target_, const at::Tensor& grad_loss_,
                                  double on_target, double uniform, bool inplace) {
  check_logits(logits, "cross_entropy_backward");
  const int64_t n = logits.size(-1), rows = logits.numel() / std::max<int64_t>(n, 1);
  const at::Tensor max = max_.to(at::kFloat).contiguous();
  const at::Tensor sum_exp = sum_exp_.to(at::kFloat).contiguous();
  const at::Tensor grad_loss = grad_loss_.to(at::kFloat).contiguous();
  const at::Tensor local_target = local_target_.to(at::kLong).contiguous();
  TORCH_CHECK(max.numel() == rows && sum_exp.numel() == rows && grad_loss.numel() == rows &&
                  local_target.numel() == rows,
              "cross_entropy_backward: per-row tensors must have logits.numel() / V/p entries");
  TORCH_CHECK(rows == 0 || local_target.max().item<int64_t>() < n,
              "cross_entropy_backward: a local target is outside [0, ", n, ")");
  at::Tensor grad = inplace ? logits : at::empty_like(logits);
  const float* m = max.data_ptr<float>();
  const float* se = sum_exp.data_ptr<float>();
  const float* g = grad_loss.data_ptr<float>();
  const int64_t* target = local_target.data_ptr<int64_t>();
  dispatch_codec(logits.scalar_type(), "cross_entropy_backward", [&](auto codec) {
    using C = decltype(codec);
    using S = typename C::storage;
    const S* l = data<C>(logits);
    S* out = data<C>(grad);
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        // The target column's softmax, read before the row is overwritten.
        const int64_t t = target[r];
        float target_value = 0.0f;
        if (t >= 0) target_value = C::to_float(l[r * n + t]);
        megatron_cpu::cross_entropy_row_grad<C>(l + r * n, n, m[r], 1.0f / se[r],
                                                static_cast<float>(uniform), g[r], out + r * n);
        if (t >= 0) {
          const float p = megatron_cpu::fast_exp(target_value - m[r]) / se[r];
          const float value = (p - static_cast<float>(uniform) -
                               static_cast<float>(on_target)) * g[r];
          out[r * n + t] = C::from_float(value);
        }
      }
    });
  });
  return grad;
}

// ---------------------------------------------------------------------------------------------
// Bias + tanh GeLU (Megatron's bias_gelu; the CUDA side keeps TorchScript, which fuses there)
// ---------------------------------------------------------------------------------------------

// y [..., f] (fp32/fp16/bf16, made contiguous) and bias [f] (y's dtype); returns y's rows count.
int64_t check_bias_gelu_input(const at::Tensor& y, const at::Tensor& bias, const char* name) {
  TORCH_CHECK(y.device().is_cpu() && bias.device().is_cpu(), name, ": expected CPU tensors");
  TORCH_CHECK(y.dim() >= 1 && bias.dim() == 1 && bias.size(0) == y.size(-1), name,
              ": expected y [..., f] and bias [f], got ", y.sizes(), " and ", bias.sizes());
  TORCH_CHECK(bias.scalar_type() == y.scalar_type(), name, ": y and bias must share one dtype");
  return y.numel() / std::max<int64_t>(y.size(-1), 1);
}

// gelu_tanh(y + bias), y's dtype; nothing is saved (the backward recomputes y + bias).
at::Tensor bias_gelu_forward(const at::Tensor& y_, const at::Tensor& bias) {
  const int64_t rows = check_bias_gelu_input(y_, bias, "bias_gelu_forward");
  const at::Tensor y = y_.contiguous();
  const int64_t f = y.size(-1);
  at::Tensor out = at::empty_like(y);
  const std::vector<float> b = to_float_vector(bias);
  dispatch_codec(y.scalar_type(), "bias_gelu_forward", [&](auto codec) {
    using C = decltype(codec);
    const auto* in = data<C>(y);
    auto* o = data<C>(out);
    at::parallel_for(0, rows, grain_for(f), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        megatron_cpu::bias_gelu_forward_row<C>(in + r * f, b.data(), f, o + r * f);
      }
    });
  });
  return out;
}

// (grad_y, grad_bias): grad * gelu_tanh'(y + bias), and its sum over the rows (fp32 partial sums
// per chunk of rows (row_chunks), added in chunk order, rounded once to the bias's dtype). With
// `sum_bias` false grad_bias is an undefined tensor (bench/bench_kernels.py compares the two).
std::vector<at::Tensor> bias_gelu_backward(const at::Tensor& grad_, const at::Tensor& y_,
                                           const at::Tensor& bias, bool sum_bias) {
  const int64_t rows = check_bias_gelu_input(y_, bias, "bias_gelu_backward");
  TORCH_CHECK(grad_.sizes() == y_.sizes() && grad_.scalar_type() == y_.scalar_type(),
              "bias_gelu_backward: grad must have y's shape and dtype");
  const at::Tensor grad = grad_.contiguous(), y = y_.contiguous();
  const int64_t f = y.size(-1);
  const int64_t chunks = row_chunks(rows);
  at::Tensor grad_y = at::empty_like(y);
  at::Tensor partial = at::zeros({sum_bias ? chunks : 0, f}, y.options().dtype(at::kFloat));
  float* partial_data = partial.data_ptr<float>();
  const std::vector<float> b = to_float_vector(bias);
  dispatch_codec(y.scalar_type(), "bias_gelu_backward", [&](auto codec) {
    using C = decltype(codec);
    const auto* dy = data<C>(grad);
    const auto* in = data<C>(y);
    auto* dx = data<C>(grad_y);
    for_each_row_chunk(rows, chunks, [&](int64_t c, int64_t row_begin, int64_t row_end) {
      for (int64_t r = row_begin; r < row_end; ++r) {
        if (sum_bias) {
          megatron_cpu::bias_gelu_backward_row<C, true>(dy + r * f, in + r * f, b.data(), f,
                                                        dx + r * f, partial_data + c * f);
        } else {
          megatron_cpu::bias_gelu_backward_row<C, false>(dy + r * f, in + r * f, b.data(), f,
                                                         dx + r * f, nullptr);
        }
      }
    });
  });
  if (!sum_bias) return {grad_y, at::Tensor()};
  return {grad_y, partial.sum(0).to(bias.scalar_type())};
}

}  // namespace

// Rows of x that linear_few_rows takes: decoding a batch of up to this many sequences.
constexpr int64_t kMaxFewRows = 8;

// F.linear of x [..., in] holding 1 to kMaxFewRows rows by weight [out, in] (+ bias [out]), in
// x's dtype with fp32 sums: decoding's matrix-vector (and few-row) products as one stream over
// the weight, the output rows split over torch's threads.
at::Tensor linear_few_rows(const at::Tensor& x, const at::Tensor& weight_,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight_.device().is_cpu(), "linear_few_rows: CPU tensors");
  TORCH_CHECK(weight_.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight_.size(1) &&
                  x.size(-1) > 0 && x.numel() / x.size(-1) >= 1 &&
                  x.numel() / x.size(-1) <= kMaxFewRows,
              "linear_few_rows: x must be 1 to ", kMaxFewRows,
              " rows [..., in] of weight [out, in]");
  TORCH_CHECK(x.scalar_type() == weight_.scalar_type(), "linear_few_rows: x and weight dtypes");
  const at::Tensor weight = weight_.contiguous();
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  const int64_t nrows = x.numel() / in_features;
  const std::vector<float> xv = to_float_vector(x);
  std::vector<float> bv;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features, "linear_few_rows: bias must be [out]");
    bv = to_float_vector(*bias);
  }
  at::Tensor y = at::empty({nrows, out_features}, x.options().dtype(at::kFloat));
  float* yd = y.data_ptr<float>();
  const float* bd = bv.empty() ? nullptr : bv.data();
  dispatch_codec(weight.scalar_type(), "linear_few_rows", [&](auto codec) {
    using C = decltype(codec);
    const auto* w = data<C>(weight);
    at::parallel_for(0, out_features, 64, [&](int64_t begin, int64_t end) {
      megatron_cpu::linear_few_rows_rows<C>(w, xv.data(), nrows, in_features, out_features,
                                            begin, end, bd, yd);
    });
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return y.to(x.scalar_type()).view(shape);
}

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
  m.def("rms_norm_forward", &rms_norm_forward,
        "fused RMS norm (Megatron's: x * rstd rounded to x's dtype, then * weight) -> (y, rstd)");
  m.def("rms_norm_backward", &rms_norm_backward,
        "fused RMS norm backward -> (grad_input, grad_weight)");
  m.def("cross_entropy_stats", &cross_entropy_stats,
        "per row of logits [..., V/p]: (max, sum exp(l - max), sum l), one read");
  m.def("cross_entropy_backward", &cross_entropy_backward,
        "(softmax - on_target * onehot - uniform) * grad_loss from the row statistics");
  m.def("linear_few_rows", &linear_few_rows,
        "F.linear of 1 to 8 rows x [..., in] by weight [out, in] (+ bias): decoding's GEMV",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("bias_gelu_forward", &bias_gelu_forward,
        "gelu_tanh(y + bias), y [..., f], bias [f]; nothing saved (backward recomputes y + bias)");
  m.def("bias_gelu_backward", &bias_gelu_backward, "bias + tanh-GeLU backward -> (grad_y, "
        "grad_bias summed over the rows in a fixed order, or undefined without sum_bias)",
        py::arg("grad"), py::arg("y"), py::arg("bias"), py::arg("sum_bias") = true);
}
