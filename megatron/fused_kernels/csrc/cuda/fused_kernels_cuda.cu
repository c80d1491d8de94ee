// Torch bindings of the CUDA kernels in fused_kernels.cuh (module megatron.fused_kernels._cuda).
// The softmax, layer-norm and RMS-norm functions of the CPU module (csrc/cpu/fused_kernels_cpu.cpp),
// with the same arguments and results; the cross entropy and bias-GeLU run as PyTorch /
// TorchScript ops on CUDA.

#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

#include "fused_kernels.cuh"

// The kernels exist for fp32, fp16 and bf16 only (torch's FLOATING_TYPES dispatch adds double).
#define DISPATCH_FLOAT_HALF_BF16(TYPE, NAME, ...)          \
  AT_DISPATCH_SWITCH(TYPE, NAME,                           \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace {

// torch's scalar type -> the CUDA type the kernels are instantiated for.
template <typename T>
struct CudaType { using type = T; };
template <>
struct CudaType<at::Half> { using type = __half; };
template <>
struct CudaType<at::BFloat16> { using type = __nv_bfloat16; };

template <typename T>
using cuda_t = typename CudaType<T>::type;

template <typename T>
const cuda_t<T>* ptr(const at::Tensor& t) {
  return reinterpret_cast<const cuda_t<T>*>(t.data_ptr<T>());
}
template <typename T>
cuda_t<T>* mut_ptr(at::Tensor& t) {
  return reinterpret_cast<cuda_t<T>*>(t.data_ptr<T>());
}

void check_input(const at::Tensor& t, int64_t dims, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, ": expected a CUDA tensor");
  TORCH_CHECK(dims < 0 || t.dim() == dims, name, ": expected a ", dims, "-D tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf ||
                  t.scalar_type() == at::kBFloat16,
              name, ": dtype must be float32, float16 or bfloat16");
}

at::Tensor scaled_softmax_forward(const at::Tensor& input_, double scale) {
  check_input(input_, 4, "scaled_softmax_forward");
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = input_.contiguous();
  at::Tensor output = at::empty_like(input);
  const int64_t n = input.size(3), rows = input.numel() / std::max<int64_t>(n, 1);
  DISPATCH_FLOAT_HALF_BF16(input.scalar_type(), "scaled_softmax",
                                  [&] {
    megatron_fused::launch_scaled_softmax(ptr<scalar_t>(input), mut_ptr<scalar_t>(output), rows,
                                          n, static_cast<float>(scale),
                                          c10::cuda::getCurrentCUDAStream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return output;
}

at::Tensor scaled_masked_softmax_forward(const at::Tensor& input_, const at::Tensor& mask_,
                                         double scale) {
  check_input(input_, 4, "scaled_masked_softmax_forward");
  TORCH_CHECK(mask_.dim() == 4 && mask_.size(1) == 1 && mask_.size(2) == input_.size(2) &&
                  mask_.size(3) == input_.size(3) &&
                  (mask_.size(0) == 1 || mask_.size(0) == input_.size(0)),
              "scaled_masked_softmax_forward: mask must be [b or 1, 1, sq, sk]");
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = input_.contiguous();
  const at::Tensor mask = mask_.to(at::kByte).contiguous();
  at::Tensor output = at::empty_like(input);
  DISPATCH_FLOAT_HALF_BF16(input.scalar_type(),
                                  "scaled_masked_softmax", [&] {
    megatron_fused::launch_scaled_masked_softmax(
        ptr<scalar_t>(input), mask.data_ptr<uint8_t>(), mut_ptr<scalar_t>(output), input.size(0),
        input.size(1), input.size(2), input.size(3), mask.size(0), static_cast<float>(scale),
        c10::cuda::getCurrentCUDAStream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return output;
}

at::Tensor scaled_upper_triang_masked_softmax_forward(const at::Tensor& input_, double scale) {
  check_input(input_, 3, "scaled_upper_triang_masked_softmax_forward");
  TORCH_CHECK(input_.size(1) <= input_.size(2),
              "scaled_upper_triang_masked_softmax_forward: needs sq <= sk");
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = input_.contiguous();
  at::Tensor output = at::empty_like(input);
  DISPATCH_FLOAT_HALF_BF16(input.scalar_type(),
                                  "scaled_upper_triang_masked_softmax", [&] {
    megatron_fused::launch_scaled_upper_triang_softmax(
        ptr<scalar_t>(input), mut_ptr<scalar_t>(output), input.size(0), input.size(1),
        input.size(2), static_cast<float>(scale), c10::cuda::getCurrentCUDAStream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return output;
}

at::Tensor softmax_backward_impl(const at::Tensor& grad_output_, const at::Tensor& output_,
                                 double scale, bool causal) {
  check_input(output_, -1, "softmax_backward");
  TORCH_CHECK(grad_output_.sizes() == output_.sizes() &&
                  grad_output_.scalar_type() == output_.scalar_type(),
              "softmax_backward: grad_output and output must match");
  const c10::cuda::CUDAGuard guard(output_.device());
  const at::Tensor grad_output = grad_output_.contiguous(), output = output_.contiguous();
  at::Tensor grad_input = at::empty_like(output);
  const int64_t n = output.size(-1), rows = output.numel() / std::max<int64_t>(n, 1);
  DISPATCH_FLOAT_HALF_BF16(output.scalar_type(),
                                  "softmax_backward", [&] {
    megatron_fused::launch_softmax_backward(ptr<scalar_t>(grad_output), ptr<scalar_t>(output),
                                            mut_ptr<scalar_t>(grad_input), rows, n,
                                            static_cast<float>(scale),
                                            causal ? output.size(-2) : 0,
                                            c10::cuda::getCurrentCUDAStream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad_input;
}

at::Tensor softmax_backward(const at::Tensor& grad_output, const at::Tensor& output,
                            double scale) {
  return softmax_backward_impl(grad_output, output, scale, false);
}

at::Tensor scaled_upper_triang_masked_softmax_backward(const at::Tensor& grad_output,
                                                       const at::Tensor& output, double scale) {
  TORCH_CHECK(output.dim() == 3 && output.size(1) <= output.size(2),
              "scaled_upper_triang_masked_softmax_backward: expected [attn_batches, sq, sk]");
  return softmax_backward_impl(grad_output, output, scale, true);
}

std::vector<at::Tensor> layer_norm_forward(const at::Tensor& input_, const at::Tensor& weight_,
                                           const at::Tensor& bias_, double eps) {
  check_input(input_, -1, "layer_norm_forward");
  const int64_t h = input_.size(-1);
  TORCH_CHECK(weight_.numel() == h && bias_.numel() == h &&
                  weight_.scalar_type() == input_.scalar_type() &&
                  bias_.scalar_type() == input_.scalar_type(),
              "layer_norm_forward: weight and bias must be [", h, "] of the input's dtype");
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = input_.contiguous();
  const at::Tensor weight = weight_.contiguous(), bias = bias_.contiguous();
  const int64_t rows = input.numel() / std::max<int64_t>(h, 1);
  at::Tensor output = at::empty_like(input);
  at::Tensor mean = at::empty({rows}, input.options().dtype(at::kFloat));
  at::Tensor invvar = at::empty({rows}, input.options().dtype(at::kFloat));
  DISPATCH_FLOAT_HALF_BF16(input.scalar_type(),
                                  "layer_norm_forward", [&] {
    megatron_fused::launch_layer_norm_forward(
        ptr<scalar_t>(input), ptr<scalar_t>(weight), ptr<scalar_t>(bias),
        mut_ptr<scalar_t>(output), mean.data_ptr<float>(), invvar.data_ptr<float>(), rows, h,
        static_cast<float>(eps), c10::cuda::getCurrentCUDAStream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {output, mean, invvar};
}

std::vector<at::Tensor> layer_norm_backward(const at::Tensor& grad_output_,
                                            const at::Tensor& input_, const at::Tensor& mean_,
                                            const at::Tensor& invvar_, const at::Tensor& weight_) {
  check_input(input_, -1, "layer_norm_backward");
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor grad_output = grad_output_.contiguous(), input = input_.contiguous();
  const at::Tensor mean = mean_.contiguous(), invvar = invvar_.contiguous();
  const at::Tensor weight = weight_.contiguous();
  const int64_t h = input.size(-1), rows = input.numel() / std::max<int64_t>(h, 1);
  at::Tensor grad_input = at::empty_like(input);
  at::Tensor dweight = at::empty({h}, input.options().dtype(at::kFloat));
  at::Tensor dbias = at::empty({h}, input.options().dtype(at::kFloat));
  DISPATCH_FLOAT_HALF_BF16(input.scalar_type(),
                                  "layer_norm_backward", [&] {
    megatron_fused::launch_layer_norm_backward(
        ptr<scalar_t>(grad_output), ptr<scalar_t>(input), mean.data_ptr<float>(),
        invvar.data_ptr<float>(), ptr<scalar_t>(weight), mut_ptr<scalar_t>(grad_input),
        dweight.data_ptr<float>(), dbias.data_ptr<float>(), rows, h,
        c10::cuda::getCurrentCUDAStream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {grad_input, dweight.to(weight.scalar_type()), dbias.to(weight.scalar_type())};
}

// RMS norm: the CPU module's rms_norm_forward / rms_norm_backward (same arguments, results).
std::vector<at::Tensor> rms_norm_forward(const at::Tensor& input_, const at::Tensor& weight_,
                                         double eps) {
  check_input(input_, -1, "rms_norm_forward");
  const int64_t h = input_.size(-1);
  TORCH_CHECK(weight_.dim() == 1 && weight_.numel() == h &&
                  weight_.scalar_type() == input_.scalar_type(),
              "rms_norm_forward: weight must be [", h, "] of the input's dtype");
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = input_.contiguous(), weight = weight_.contiguous();
  const int64_t rows = input.numel() / std::max<int64_t>(h, 1);
  at::Tensor output = at::empty_like(input);
  at::Tensor invrms = at::empty({rows}, input.options().dtype(at::kFloat));
  DISPATCH_FLOAT_HALF_BF16(input.scalar_type(), "rms_norm_forward", [&] {
    megatron_fused::launch_rms_norm_forward(
        ptr<scalar_t>(input), ptr<scalar_t>(weight), mut_ptr<scalar_t>(output),
        invrms.data_ptr<float>(), rows, h, static_cast<float>(eps),
        c10::cuda::getCurrentCUDAStream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {output, invrms};
}

std::vector<at::Tensor> rms_norm_backward(const at::Tensor& grad_output_,
                                          const at::Tensor& input_, const at::Tensor& invrms_,
                                          const at::Tensor& weight_) {
  check_input(input_, -1, "rms_norm_backward");
  TORCH_CHECK(grad_output_.sizes() == input_.sizes() &&
                  grad_output_.scalar_type() == input_.scalar_type(),
              "rms_norm_backward: grad_output must have the input's shape and dtype");
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor grad_output = grad_output_.contiguous(), input = input_.contiguous();
  const at::Tensor invrms = invrms_.to(at::kFloat).contiguous(), weight = weight_.contiguous();
  const int64_t h = input.size(-1), rows = input.numel() / std::max<int64_t>(h, 1);
  TORCH_CHECK(invrms.numel() == rows, "rms_norm_backward: one statistic per row expected");
  at::Tensor grad_input = at::empty_like(input);
  at::Tensor partial = at::empty({megatron_fused::weight_grad_chunks(rows), h},
                                 input.options().dtype(at::kFloat));
  DISPATCH_FLOAT_HALF_BF16(input.scalar_type(), "rms_norm_backward", [&] {
    megatron_fused::launch_rms_norm_backward(
        ptr<scalar_t>(grad_output), ptr<scalar_t>(input), invrms.data_ptr<float>(),
        ptr<scalar_t>(weight), mut_ptr<scalar_t>(grad_input), partial.data_ptr<float>(), rows,
        h, c10::cuda::getCurrentCUDAStream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {grad_input, partial.sum(0).to(weight.scalar_type())};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Megatron fused kernels, CUDA";
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
}
