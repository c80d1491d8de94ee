// Per-row CPU kernels of the fused softmax, layer norm, RMS norm, cross entropy and bias + GeLU,
// on plain pointers.
//
// Depends on the C++ standard library only (fused_kernels_cpu.cpp binds them to torch and
// instantiates them for float, bf16 and fp16), so the vectoriser's report can be read on a file
// that includes this header and instantiates the templates, without torch's headers:
//   g++ -O3 -march=native -fno-math-errno -fno-trapping-math -fopenmp-simd
//       -fopt-info-vec-optimized -c instantiate.cpp   (one command line)
//
// Speed rules the code follows (each found by measurement, docs/benchmarks.md):
// * every inner loop works on fp32 (or on the raw 16 bits of a bf16) over contiguous memory, with
//   no calls and no branches, so that `#pragma omp simd` turns it into AVX2/AVX-512 code;
// * half precision is converted inside those loops (bf16 by bit shifts, which vectorise; c10's
//   conversion does not), so a row is not copied to convert it;
// * a row is read from memory once: the first pass converts it into an L1-sized fp32 buffer and
//   the later passes (exp and sum, normalise-and-store) run on that buffer; the 50k-wide
//   cross-entropy rows are streamed in blocks with an online (running max, rescaled sum) softmax.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace megatron_cpu {

constexpr float kMaskedScore = -10000.0f;

// max/min as one maxps/minps: std::fmax/fmin keep IEEE NaN rules and compile to libm calls,
// which stop the vectoriser. A NaN still reaches the sums (and the loss) through the exp pass.
inline float max_f(float a, float b) { return a > b ? a : b; }
inline float min_f(float a, float b) { return a < b ? a : b; }

// exp(x) in fp32 without calls or branches, so that loops calling it vectorise. Cephes' expf:
// x = n ln2 + r with |r| <= ln2/2 (n rounded by the 1.5 * 2^23 trick), a degree-6 polynomial
// for e^r, 2^n built in the exponent bits. Error <= 2 ulp over the normal range; inputs below
// -87.3 (e^x subnormal) return exactly 0, as the masked -10000 scores must.
inline float fast_exp(float x) {
  const float clamped = min_f(max_f(x, -87.3f), 88.3f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = clamped * 1.44269504088896341f + shifter;
  const float n = t - shifter;
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t t_bits;
  std::memcpy(&t_bits, &t, sizeof(t_bits));
  int32_t shifter_bits;
  std::memcpy(&shifter_bits, &shifter, sizeof(shifter_bits));
  const int32_t bits = (t_bits - shifter_bits + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  const float keep = x >= -87.3f ? 1.0f : 0.0f;
  return x != x ? x : p * two_n * keep;  // NaN propagates (the loss's NaN check sees it)
}

// Storage codecs: element conversions storage <-> fp32, inlined into the loops below (one pass
// reads the stored row and computes; one pass computes and stores), plus whole-row load/store
// for the loops that revisit a row. The fp16 codec lives with torch's Half type in
// fused_kernels_cpu.cpp.
struct FloatCodec {
  using storage = float;
  static float to_float(float v) { return v; }
  static float from_float(float v) { return v; }
  static void load(const float* src, float* dst, int64_t n) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  }
};

// bf16 as its raw 16 bits: the high half of an fp32. Bit shifts, which vectorise.
struct Bf16Codec {
  using storage = uint16_t;
  static float to_float(uint16_t v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  }
  // Round to nearest even, as c10::BFloat16 does; NaN stays a (quiet) NaN.
  static uint16_t from_float(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return static_cast<uint16_t>(v != v ? 0x7fc0u : rounded);
  }
  static void load(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
  }
};

template <typename C>
inline void store_zeros(typename C::storage* dst, int64_t n) {
  if (n > 0) std::memset(dst, 0, static_cast<size_t>(n) * sizeof(*dst));  // 0.0 in every dtype
}

// ---------------------------------------------------------------------------------------------
// Softmax
// ---------------------------------------------------------------------------------------------

// y = softmax(scale * x) over the first `valid` of `n` entries, zeros after them. `mask` (may be
// null) marks masked entries, which score -10000 as in Megatron's kernels; a row with every
// entry masked outputs zeros. `buf`: fp32 scratch of n floats.
template <typename C>
void softmax_forward_row(const typename C::storage* x, const uint8_t* mask, int64_t valid,
                         int64_t n, float scale, typename C::storage* y, float* buf) {
  if (valid <= 0) {
    store_zeros<C>(y, n);
    return;
  }
  float max_value = -INFINITY;
  if (mask != nullptr) {
    int64_t unmasked = 0;
#pragma omp simd reduction(max : max_value) reduction(+ : unmasked)
    for (int64_t i = 0; i < valid; ++i) {
      const bool keep = mask[i] == 0;
      buf[i] = keep ? C::to_float(x[i]) * scale : kMaskedScore;
      max_value = max_f(max_value, buf[i]);
      unmasked += keep ? 1 : 0;
    }
    if (unmasked == 0) {  // Megatron's kernels write zeros for a fully masked row
      store_zeros<C>(y, n);
      return;
    }
  } else {
#pragma omp simd reduction(max : max_value)
    for (int64_t i = 0; i < valid; ++i) {
      buf[i] = C::to_float(x[i]) * scale;
      max_value = max_f(max_value, buf[i]);
    }
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < valid; ++i) {
    buf[i] = fast_exp(buf[i] - max_value);
    sum += buf[i];
  }
  const float inv_sum = 1.0f / sum;
#pragma omp simd
  for (int64_t i = 0; i < valid; ++i) y[i] = C::from_float(buf[i] * inv_sum);
  store_zeros<C>(y + valid, n - valid);
}

// dx = scale * y * (dy - sum(dy * y)) over the first `valid` entries, zeros after them (y is 0
// there). The row is read twice (the second time from L1).
template <typename C>
void softmax_backward_row(const typename C::storage* dy, const typename C::storage* y,
                          int64_t valid, int64_t n, float scale, typename C::storage* dx) {
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t i = 0; i < valid; ++i) dot += C::to_float(dy[i]) * C::to_float(y[i]);
#pragma omp simd
  for (int64_t i = 0; i < valid; ++i) {
    dx[i] = C::from_float(scale * C::to_float(y[i]) * (C::to_float(dy[i]) - dot));
  }
  store_zeros<C>(dx + valid, n - valid);
}

// ---------------------------------------------------------------------------------------------
// Layer norm
// ---------------------------------------------------------------------------------------------

// One row: y = (x - mean) * rstd * w + b with fp32 w, b; returns mean and rstd. `row`: h floats.
template <typename C>
void layer_norm_forward_row(const typename C::storage* x, const float* w, const float* b,
                            int64_t h, float eps, typename C::storage* y, float* row,
                            float* mean_out, float* rstd_out) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < h; ++i) {
    row[i] = C::to_float(x[i]);
    sum += row[i];
  }
  const float mu = sum / static_cast<float>(h);
  // The variance of the centred (cached) row: E[x^2] - mean^2 would cancel digits.
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < h; ++i) squares += (row[i] - mu) * (row[i] - mu);
  const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) y[i] = C::from_float((row[i] - mu) * rstd * w[i] + b[i]);
  *mean_out = mu;
  *rstd_out = rstd;
}

// One row of the backward: dx into `dx`, and dw += dy * xhat, db += dy into fp32 partial sums.
// `xhat`, `g`: h floats of scratch each.
template <typename C>
void layer_norm_backward_row(const typename C::storage* dy, const typename C::storage* x,
                             float mu, float rstd, const float* w, int64_t h,
                             typename C::storage* dx, float* dw, float* db, float* xhat,
                             float* g) {
  float sum_g = 0.0f, sum_g_xhat = 0.0f;
#pragma omp simd reduction(+ : sum_g, sum_g_xhat)
  for (int64_t i = 0; i < h; ++i) {
    const float d = C::to_float(dy[i]);
    const float xh = (C::to_float(x[i]) - mu) * rstd;
    xhat[i] = xh;
    dw[i] += d * xh;
    db[i] += d;
    g[i] = d * w[i];
    sum_g += g[i];
    sum_g_xhat += g[i] * xh;
  }
  const float mean_g = sum_g / static_cast<float>(h);
  const float mean_g_xhat = sum_g_xhat / static_cast<float>(h);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    dx[i] = C::from_float(rstd * (g[i] - mean_g - xhat[i] * mean_g_xhat));
  }
}

// ---------------------------------------------------------------------------------------------
// RMS norm (Megatron-LM's RMSNorm: no mean, no bias)
// ---------------------------------------------------------------------------------------------

// v rounded to the storage dtype and back: the identity for fp32.
template <typename C>
inline float round_to_storage(float v) {
  return C::to_float(C::from_float(v));
}

// One row: n = x * rstd in fp32, rounded to the storage dtype, then times w, rounded again; as
// Megatron's PyTorch RMSNorm (`_norm(x.float()).type_as(x) * weight`: the weight multiplies in
// the input's dtype). Returns rstd = 1 / sqrt(mean(x^2) + eps). The row is read twice (the
// second time from L1), which costs less than an fp32 copy of it.
template <typename C>
void rms_norm_forward_row(const typename C::storage* x, const float* w, int64_t h, float eps,
                          typename C::storage* y, float* rstd_out) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < h; ++i) {
    const float v = C::to_float(x[i]);
    squares += v * v;
  }
  const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    y[i] = C::from_float(round_to_storage<C>(C::to_float(x[i]) * rstd) * w[i]);
  }
  *rstd_out = rstd;
}

// One row of the backward: dx = rstd * (g - n * mean(g * n)) with g = dy * w, n = x * rstd
// (the rounding of n to storage in the forward is taken as the identity, as autograd does
// through Megatron's cast); dw += dy * n into fp32 partial sums, n rounded to storage as the
// forward multiplied it.
template <typename C>
void rms_norm_backward_row(const typename C::storage* dy, const typename C::storage* x,
                           float rstd, const float* w, int64_t h, typename C::storage* dx,
                           float* dw) {
  float sum_g_n = 0.0f;
#pragma omp simd reduction(+ : sum_g_n)
  for (int64_t i = 0; i < h; ++i) {
    const float d = C::to_float(dy[i]);
    const float n = C::to_float(x[i]) * rstd;
    dw[i] += d * round_to_storage<C>(n);
    sum_g_n += d * w[i] * n;
  }
  const float mean_g_n = sum_g_n / static_cast<float>(h);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    const float n = C::to_float(x[i]) * rstd;
    dx[i] = C::from_float(rstd * (C::to_float(dy[i]) * w[i] - n * mean_g_n));
  }
}

// ---------------------------------------------------------------------------------------------
// Cross entropy over a (vocabulary-parallel) row of logits
// ---------------------------------------------------------------------------------------------

constexpr int64_t kCrossEntropyBlock = 2048;  // floats per streamed block: 8 KiB, L1-resident

// Online softmax statistics of one row in a single read: max m, sum exp(l - m), and (for label
// smoothing) the plain sum of the logits. `buf`: kCrossEntropyBlock floats.
template <typename C>
void cross_entropy_row_stats(const typename C::storage* logits, int64_t n, float* max_out,
                             float* sum_exp_out, float* sum_out, float* buf) {
  float running_max = -INFINITY, running_sum = 0.0f, plain_sum = 0.0f;
  for (int64_t start = 0; start < n; start += kCrossEntropyBlock) {
    const int64_t len = std::min(kCrossEntropyBlock, n - start);
    float block_max = -INFINITY, block_sum = 0.0f;
#pragma omp simd reduction(max : block_max) reduction(+ : block_sum)
    for (int64_t i = 0; i < len; ++i) {
      buf[i] = C::to_float(logits[start + i]);
      block_max = max_f(block_max, buf[i]);
      block_sum += buf[i];
    }
    plain_sum += block_sum;
    const float new_max = max_f(running_max, block_max);
    float exp_sum = 0.0f;
#pragma omp simd reduction(+ : exp_sum)
    for (int64_t i = 0; i < len; ++i) exp_sum += fast_exp(buf[i] - new_max);
    // The first block has running_sum == 0, so exp(-inf) (0 from fast_exp) times it is 0.
    running_sum = running_sum * fast_exp(running_max - new_max) + exp_sum;
    running_max = new_max;
  }
  *max_out = running_max;
  *sum_exp_out = running_sum;
  *sum_out = plain_sum;
}

// grad = (exp(l - m) / s - smoothing / V) * g, written over `out`, which may be `logits`
// itself (each element is read before it is written). The target's (1 - smoothing) * g is
// subtracted by the caller, which knows which rank holds the target.
template <typename C>
void cross_entropy_row_grad(const typename C::storage* logits, int64_t n, float max_value,
                            float inv_sum_exp, float uniform, float g,
                            typename C::storage* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float p = fast_exp(C::to_float(logits[i]) - max_value) * inv_sum_exp;
    out[i] = C::from_float((p - uniform) * g);
  }
}

// ---------------------------------------------------------------------------------------------
// Bias + tanh GeLU (Megatron's bias_gelu)
// ---------------------------------------------------------------------------------------------

constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi), Megatron's 0.79788456
constexpr float kGeluKappa = 0.044715f;
// Where exp(-2u) > e^80 the gate is below 2e-35: it is flushed to 0, as ATen's tanh(u) is
// exactly -1 there, so that x * gate stays clear of subnormals (slow) and large negative x give
// -0 and a zero gradient, x = -inf NaN, as ATen does.
constexpr float kGeluFlushExponent = 80.0f;

// The tanh GeLU is 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = beta (x + kappa x^3): one fast_exp
// and one division instead of a libm tanh (a call, which would keep the loops scalar).
// `minus_two_u` = -2u, `e` = exp(-2u); x^3 overflowing to +-inf gives gate 1 or 0, the limits.
inline float gelu_tanh_gate(float minus_two_u, float e) {
  const float gate = 1.0f / (1.0f + e);
  return minus_two_u < kGeluFlushExponent ? gate : 0.0f;  // NaN compares false: x carries it
}

// out = gelu_tanh(y + bias) over one row of n; `bias`: n fp32 values.
template <typename C>
void bias_gelu_forward_row(const typename C::storage* y, const float* bias, int64_t n,
                           typename C::storage* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = C::to_float(y[i]) + bias[i];
    const float minus_two_u = -2.0f * kGeluBeta * (x + kGeluKappa * x * x * x);
    out[i] = C::from_float(x * gelu_tanh_gate(minus_two_u, fast_exp(minus_two_u)));
  }
}

// grad_y = grad * gelu_tanh'(y + bias) over one row, the sum y + bias recomputed (Megatron saves y
// and the bias, not the sum); grad_bias[i] += grad_y[i] in fp32 (before rounding to storage).
// d/dx x s(2u) = s + x s (1 - s) 2 beta (1 + 3 kappa x^2), with s (1 - s) = e s^2 (e = exp(-2u)):
// 1 - s would cancel digits where s is near 1. Where s is exactly 0 or 1 (e finite: fast_exp
// clamps) the second term is 0 for finite x^2, and NaN where x^2 overflows, as in ATen.
template <typename C, bool kSumBias = true>
void bias_gelu_backward_row(const typename C::storage* grad, const typename C::storage* y,
                            const float* bias, int64_t n, typename C::storage* grad_y,
                            float* grad_bias) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = C::to_float(y[i]) + bias[i];
    const float x_sq = x * x;
    const float minus_two_u = -2.0f * kGeluBeta * (x + kGeluKappa * x_sq * x);
    const float e = fast_exp(minus_two_u);
    const float s = gelu_tanh_gate(minus_two_u, e);
    const float slope = 2.0f * kGeluBeta * (1.0f + 3.0f * kGeluKappa * x_sq);
    const float g = C::to_float(grad[i]) * (s + x * (e * s * s) * slope);
    grad_y[i] = C::from_float(g);
    if (kSumBias) grad_bias[i] += g;
  }
}

// ---------------------------------------------------------------------------------------------
// One-row linear layer (batch-1 decoding): y = W x + b, W row-major [out, in]
// ---------------------------------------------------------------------------------------------

// y[r] = dot(W[r, :], x) + bias[r] for the rows [begin, end): a chain of such products reads
// every weight once per token, so the loop is a pure stream over W. Four rows at a time keep
// four independent sums in flight and let each load of x serve four rows. `bias` may be null.
template <typename C>
void linear_one_row_rows(const typename C::storage* w, const float* x, int64_t in,
                         int64_t begin, int64_t end, const float* bias, float* y) {
  int64_t r = begin;
  for (; r + 4 <= end; r += 4) {
    const typename C::storage* w0 = w + r * in;
    const typename C::storage* w1 = w0 + in;
    const typename C::storage* w2 = w1 + in;
    const typename C::storage* w3 = w2 + in;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t i = 0; i < in; ++i) {
      const float xi = x[i];
      a0 += C::to_float(w0[i]) * xi;
      a1 += C::to_float(w1[i]) * xi;
      a2 += C::to_float(w2[i]) * xi;
      a3 += C::to_float(w3[i]) * xi;
    }
    y[r] = a0 + (bias ? bias[r] : 0.0f);
    y[r + 1] = a1 + (bias ? bias[r + 1] : 0.0f);
    y[r + 2] = a2 + (bias ? bias[r + 2] : 0.0f);
    y[r + 3] = a3 + (bias ? bias[r + 3] : 0.0f);
  }
  for (; r < end; ++r) {
    const typename C::storage* wr = w + r * in;
    float a = 0.0f;
#pragma omp simd reduction(+ : a)
    for (int64_t i = 0; i < in; ++i) a += C::to_float(wr[i]) * x[i];
    y[r] = a + (bias ? bias[r] : 0.0f);
  }
}

// The same for a few rows of x at once (x: `nrows` rows of `in` floats; y: `nrows` rows of
// `out`): each block of four weight rows is read from memory once and reused from L1/L2 for
// every row of x, two rows of x per pass (eight sums: within AVX2's sixteen registers). One row
// is linear_one_row_rows.
template <typename C>
void linear_few_rows_rows(const typename C::storage* w, const float* x, int64_t nrows,
                          int64_t in, int64_t out, int64_t begin, int64_t end, const float* bias,
                          float* y) {
  if (nrows == 1) {
    linear_one_row_rows<C>(w, x, in, begin, end, bias, y);
    return;
  }
  int64_t r = begin;
  for (; r + 4 <= end; r += 4) {
    const typename C::storage* w0 = w + r * in;
    const typename C::storage* w1 = w0 + in;
    const typename C::storage* w2 = w1 + in;
    const typename C::storage* w3 = w2 + in;
    int64_t m = 0;
    for (; m + 2 <= nrows; m += 2) {
      const float* xa = x + m * in;
      const float* xb = xa + in;
      float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
      float b0 = 0.0f, b1 = 0.0f, b2 = 0.0f, b3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3)
      for (int64_t i = 0; i < in; ++i) {
        const float v0 = C::to_float(w0[i]), v1 = C::to_float(w1[i]);
        const float v2 = C::to_float(w2[i]), v3 = C::to_float(w3[i]);
        a0 += v0 * xa[i];
        a1 += v1 * xa[i];
        a2 += v2 * xa[i];
        a3 += v3 * xa[i];
        b0 += v0 * xb[i];
        b1 += v1 * xb[i];
        b2 += v2 * xb[i];
        b3 += v3 * xb[i];
      }
      const float sums[8] = {a0, a1, a2, a3, b0, b1, b2, b3};
      for (int64_t k = 0; k < 8; ++k) {
        const int64_t row = r + k % 4;
        y[(m + k / 4) * out + row] = sums[k] + (bias ? bias[row] : 0.0f);
      }
    }
    if (m < nrows) linear_one_row_rows<C>(w, x + m * in, in, r, r + 4, bias, y + m * out);
  }
  for (int64_t m = 0; m < nrows; ++m) {
    linear_one_row_rows<C>(w, x + m * in, in, r, end, bias, y + m * out);
  }
}

}  // namespace megatron_cpu
