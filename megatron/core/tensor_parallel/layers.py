"""Tensor-parallel building blocks: column- and row-parallel linear layers and the
vocabulary-parallel embedding (Megatron-LM paper, section 3).

Shapes: ``p`` TP size; inputs are ``[..., in]`` (the transformer passes ``[s, b, h]``).
Every layer takes its TP group ``tp_group`` explicitly (``None`` = this rank alone: no tensor
parallelism).

Initialization, as Megatron's: with ``use_cpu_initialization`` (the layers' default, and the
training default on a CPU device) the full weight is drawn on the CPU from torch's default
generator (seeded identically on all TP ranks by the training code) and each rank keeps its
slice, so TP = 1, 2, 4 build the same full model. Without it (the training default on a GPU)
each rank draws only its shard, on the device, from the model-parallel RNG stream: 1/TP of the
work, and no full fp32 weight on the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron.core import comm
from megatron.core import device as device_mod
from megatron.core.fusions import fused_linear_few_rows
from megatron.core.tensor_parallel.mappings import (communicate,
                                                    copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region,
                                                    gather_from_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region,
                                                    scatter_to_tensor_model_parallel_region)
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.core.tensor_parallel.utils import (ProcessGroup, divide,
                                                 set_sequence_parallel_attribute,
                                                 set_tensor_model_parallel_attributes,
                                                 split_master_weight, tp_rank, tp_world_size,
                                                 vocab_range)

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def init_method_normal(std: float) -> InitMethod:
    """In-place N(0, std) initializer."""
    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)
    return init_


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """N(0, std / sqrt(2 num_layers)) for the output projections (paper, section 4.2)."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def master_dtype(params_dtype: torch.dtype) -> torch.dtype:
    # Megatron draws fp32 master weights, then casts; float64 (tests) keeps its precision.
    return torch.float64 if params_dtype == torch.float64 else torch.float32


def _init_sharded_weight(full_shape: tuple[int, int], partition_dim: int, stride: int,
                         init_method: InitMethod, tp_group: ProcessGroup | None,
                         params_dtype: torch.dtype, device: torch.device | None,
                         use_cpu_initialization: bool = True,
                         perform_initialization: bool = True) -> torch.nn.Parameter:
    """This rank's shard of a ``full_shape`` weight split along ``partition_dim``, with the TP
    attributes marked. ``use_cpu_initialization``: the full weight is drawn on the CPU and
    sliced (the same full weight at every TP size); else the shard alone is drawn on the
    device from the model-parallel RNG stream. ``perform_initialization`` False: no draw."""
    dev = device or device_mod.get_device()
    tp = tp_world_size(tp_group)
    shard_shape = list(full_shape)
    shard_shape[partition_dim] = divide(shard_shape[partition_dim], tp)
    if not perform_initialization:
        shard = torch.empty(shard_shape, dtype=params_dtype, device=dev)
    elif use_cpu_initialization:
        master = torch.empty(full_shape, dtype=master_dtype(params_dtype), device="cpu")
        init_method(master)
        shard = split_master_weight(master.to(params_dtype), partition_dim, tp,
                                    tp_rank(tp_group), stride).to(dev)
    else:
        shard = torch.empty(shard_shape, dtype=params_dtype, device=dev)
        with get_rng_tracker().fork():
            init_method(shard)
    weight = torch.nn.Parameter(shard)
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    return weight


def column_parallel_weight(output_size: int, input_size: int, *,
                           tp_group: ProcessGroup | None, init_method: InitMethod,
                           params_dtype: torch.dtype = torch.float32,
                           device: torch.device | None = None,
                           use_cpu_initialization: bool = True,
                           perform_initialization: bool = True) -> torch.nn.Parameter:
    """This rank's ``[out/p, in]`` rows of an output-split weight, drawn as
    :class:`ColumnParallelLinear`'s (for a weight whose product another function computes, such
    as the untied output layer's in :func:`column_parallel_linear`)."""
    return _init_sharded_weight((output_size, input_size), 0, 1, init_method, tp_group,
                                params_dtype, device, use_cpu_initialization,
                                perform_initialization)


def init_options(config) -> dict:
    """The initialization keywords of the TP layers from a ``TransformerConfig``."""
    return dict(use_cpu_initialization=config.use_cpu_initialization,
                perform_initialization=config.perform_initialization)


def _swap_stride_blocks(x: torch.Tensor, outer: int, inner: int) -> torch.Tensor:
    """Read the last dimension as ``[outer, inner, block]`` and return it as
    ``[inner, outer, block]``: converts between the full order of a ``stride``-split dimension
    (``[stride, p, block]``: block ``j p + r`` belongs to rank r) and the rank-major order of its
    concatenated shards (``[p, stride, block]``)."""
    if outer == 1 or inner == 1:
        return x
    return x.unflatten(-1, (outer, inner, -1)).transpose(-3, -2).flatten(-3)


def _zero_bias(size: int, params_dtype: torch.dtype,
               device: torch.device | None) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(size, dtype=params_dtype,
                                          device=device or device_mod.get_device()))


class _LinearWithGradAccumulationFusion(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight gradient straight into ``weight.main_grad``
    (``--gradient-accumulation-fusion``, Megatron's ``wgrad_gemm_accum_fp32``).

    With the data-parallel gradient buffer in place the weight gradient GEMM writes into the
    buffer (``addmm_``: main_grad += dY^T X, one GEMM with beta = 1) and ``weight.grad`` stays
    ``None``, saving the weight-gradient tensor and the pass that adds it to the buffer. Without
    a buffer (no DDP wrapper, or after ``finish_grad_sync`` of the non-contiguous path) it
    returns the gradient as ``F.linear`` does. When the buffer's dtype differs from the
    activations' (bf16 activations, fp32 buffer), CUDA's ``addmm(..., out_dtype=float32)``
    accumulates the half-precision product into the fp32 buffer in the GEMM itself (Megatron's
    fused wgrad); the CPU has no mixed-dtype GEMM, so there the product is computed in the
    activation dtype and then added (no saving).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight)  # [..., in]
        grad_weight, grad_bias = _weight_and_bias_grads(grad_out, x, weight, True,
                                                        ctx.has_bias)
        return grad_x, grad_weight, grad_bias


class _LinearWithAsyncInputGradAllReduce(torch.autograd.Function):
    """``F.linear`` of an input replicated on every TP rank (a column-parallel layer without
    sequence parallelism: the paper's *f* then the linear), Megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication`` with ``allreduce_dgrad``: the backward
    starts the all-reduce of the input gradient (a partial sum over this rank's output slice)
    and computes the weight gradient while it runs, instead of waiting for the whole linear
    backward before a separate all-reduce."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp_group, fuse_accumulation):
        ctx.save_for_backward(x, weight)
        ctx.tp_group, ctx.fuse_accumulation = tp_group, fuse_accumulation
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x, reducing = None, None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.matmul(weight)  # [..., in], this rank's partial sum
            reducing = comm.all_reduce(grad_x, ctx.tp_group, async_op=True)
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_weight, grad_bias = _weight_and_bias_grads(grad_out, x, weight,
                                                            ctx.fuse_accumulation, ctx.has_bias)
        comm.wait(reducing, "all_reduce", ctx.tp_group)
        return grad_x, grad_weight, grad_bias, None, None


def _weight_and_bias_grads(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           fuse_accumulation: bool, has_bias: bool):
    """The weight and bias gradients of ``F.linear(x, weight, bias)``; with
    ``fuse_accumulation`` and a ``weight.main_grad`` the weight's is added into it instead and
    None is returned (a None weight gradient still runs the parameter's post-accumulate-grad
    hook, so the DDP wrapper's bucket bookkeeping sees the weight as ready)."""
    grad_2d = grad_out.reshape(-1, grad_out.size(-1))  # [tokens, out]
    x_2d = x.reshape(-1, x.size(-1))  # [tokens, in]
    main_grad = getattr(weight, "main_grad", None) if fuse_accumulation else None
    grad_weight = None
    if main_grad is None:
        grad_weight = grad_2d.t().mm(x_2d)
    elif main_grad.dtype == grad_2d.dtype:
        main_grad.addmm_(grad_2d.t(), x_2d)
    elif not _accumulate_in_fp32(main_grad, grad_2d.t(), x_2d):
        main_grad.add_(grad_2d.t().mm(x_2d))
    return grad_weight, (grad_2d.sum(0) if has_bias else None)


class _SequenceParallelLinear(torch.autograd.Function):
    """``F.linear`` of the sequence all-gathered input: ``x [s/p, b, in]`` -> ``[s, b, out/p]``
    (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` with sequence parallelism).

    Only this rank's ``[s/p, b, in]`` is kept for backward, which all-gathers it again (the
    paper's accounting: the gathered input is never stored), while the input gradient is
    computed; the input gradient, a partial sum over this rank's output slice, is then
    reduce-scattered back to ``[s/p, b, in]`` while the weight gradient is computed.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, tp_group, fuse_accumulation):
        ctx.save_for_backward(x, weight)
        ctx.tp_group, ctx.fuse_accumulation = tp_group, fuse_accumulation
        ctx.has_bias = bias is not None
        return F.linear(_gather_sequence(x, tp_group), weight, bias)  # [s, b, out/p]

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group = ctx.tp_group
        total = torch.empty((x.size(0) * tp_world_size(group), *x.shape[1:]), dtype=x.dtype,
                            device=x.device)  # [s, b, in]
        gathering = comm.all_gather_into(total, x, group, async_op=True)
        grad_total = grad_out.matmul(weight)  # [s, b, in], this rank's partial sum
        comm.wait(gathering, "all_gather", group)
        grad_x = torch.empty_like(x)  # [s/p, b, in]
        scattering = comm.reduce_scatter_into(grad_x, grad_total, group, async_op=True)
        grad_weight, grad_bias = _weight_and_bias_grads(grad_out, total, weight,
                                                        ctx.fuse_accumulation, ctx.has_bias)
        comm.wait(scattering, "reduce_scatter", group)
        return grad_x, grad_weight, grad_bias, None, None


def _gather_sequence(x: torch.Tensor, tp_group: ProcessGroup | None) -> torch.Tensor:
    """``[s/p, ...]`` -> ``[s, ...]``, no autograd."""
    out = torch.empty((x.size(0) * tp_world_size(tp_group), *x.shape[1:]), dtype=x.dtype,
                      device=x.device)
    comm.all_gather_into(out, x.contiguous(), tp_group)
    return out


_MIXED_DTYPE_ADDMM = {"cuda": True}  # False once torch refuses it (older releases)


def _accumulate_in_fp32(main_grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``main_grad += a @ b`` for half ``a``, ``b`` and an fp32 ``main_grad`` in one GEMM where
    the device has such a GEMM; False (nothing done) where it has not."""
    if not _MIXED_DTYPE_ADDMM.get(main_grad.device.type, False) \
            or main_grad.dtype != torch.float32:
        return False
    try:
        torch.addmm(main_grad, a, b, out_dtype=torch.float32, out=main_grad)
    except (TypeError, RuntimeError, NotImplementedError):
        _MIXED_DTYPE_ADDMM[main_grad.device.type] = False
        return False
    return True


def sequence_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             tp_group: ProcessGroup | None,
                             gradient_accumulation_fusion: bool = False) -> torch.Tensor:
    """A column-parallel ``F.linear`` whose input is split along the sequence:
    ``x [s/p, b, in]`` is all-gathered to ``[s, b, in]`` first, and in backward the input
    gradient is reduce-scattered back to ``[s/p, b, in]`` (the gathered input is not stored)."""
    if tp_world_size(tp_group) == 1:
        return _linear(x, weight, bias, gradient_accumulation_fusion)
    if torch.compiler.is_compiling():
        # Traced: the gather as a functional collective, whose backward reduce-scatters.
        x = gather_from_sequence_parallel_region(x, tp_group)  # [s, b, in]
        return _linear(x, weight, bias, gradient_accumulation_fusion)
    return communicate(_SequenceParallelLinear, x, weight, bias, tp_group,
                       gradient_accumulation_fusion)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            gradient_accumulation_fusion: bool) -> torch.Tensor:
    # Inside a compiled layer (--compile-layers) the weight gradient comes out of the compiled
    # backward as weight.grad, which the DDP hook adds into main_grad: a Function whose
    # backward writes a tensor attribute cannot be traced.
    if gradient_accumulation_fusion and weight.requires_grad and torch.is_grad_enabled() \
            and not torch.compiler.is_compiling():
        return _LinearWithGradAccumulationFusion.apply(x, weight, bias)
    return fused_linear_few_rows.linear(x, weight, bias)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           tp_group: ProcessGroup | None,
                           gradient_accumulation_fusion: bool = False,
                           sequence_parallel: bool = False) -> torch.Tensor:
    """``F.linear`` with this rank's output slice ``weight [out/p, in]`` of an input that every
    TP rank holds (``x [..., in]``; with ``sequence_parallel`` this rank's ``[s/p, b, in]`` rows,
    all-gathered first): the paper's *f* and the linear in one, whose backward all-reduces (or
    reduce-scatters) the input gradient while the weight gradient is computed, and adds the
    weight gradient into ``weight.main_grad`` with ``gradient_accumulation_fusion``. Returns
    ``[..., out/p]`` (``[s, b, out/p]``)."""
    if sequence_parallel:
        return sequence_parallel_linear(x, weight, bias, tp_group, gradient_accumulation_fusion)
    if tp_world_size(tp_group) > 1 and torch.is_grad_enabled() \
            and not torch.compiler.is_compiling():
        return communicate(_LinearWithAsyncInputGradAllReduce, x, weight, bias, tp_group,
                           gradient_accumulation_fusion)
    x = copy_to_tensor_model_parallel_region(x, tp_group, grad_in_place=True)
    return _linear(x, weight, bias, gradient_accumulation_fusion)


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A + b`` with ``A`` split along its output dimension: ``A = [A_1, ..., A_p]``.

    Args:
        input_size: ``in`` of the full layer.
        output_size: ``out`` of the full layer (divisible by the TP size).
        tp_group: the TP process group (``None`` = this rank alone: no tensor parallelism).
        init_method: in-place initializer of the full ``[out, in]`` weight.
        bias: add a bias (split with the output, zero-initialized).
        gather_output: all-gather the output so every rank holds ``[..., out]`` (in the full
            layer's order, also with ``stride`` > 1); otherwise each rank returns its
            ``[..., out/p]`` slice.
        stride: interleaving of the output split (fused weights; 1 = contiguous blocks): the
            output is cut in ``p * stride`` blocks and rank r holds blocks r, r + p, ...
        skip_bias_add: return the bias instead of adding it, for a later fused bias op.
        params_dtype: dtype of the parameters.
        device: where parameters live (default: :func:`megatron.core.device.get_device`).
        gradient_accumulation_fusion: accumulate the weight gradient straight into
            ``weight.main_grad`` when the DDP wrapper gave it one.
        sequence_parallel: the input is split along the sequence, ``[s/p, b, in]``, and
            all-gathered here (sequence parallelism); the output is ``[s, b, out/p]``.
        use_cpu_initialization: draw the full weight on the CPU and keep this rank's slice
            (TP-invariant); False: draw this rank's shard on the device from the
            model-parallel RNG stream.
        perform_initialization: False leaves the weight undrawn (a checkpoint load follows).
        explicit_expert_comm: split the weight over ``tp_group`` but communicate nothing: the
            MoE token dispatcher moves the inputs and sums the gradients (Megatron's expert
            layers, ``explicit_expert_comm``).
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group: ProcessGroup | None,
                 init_method: InitMethod, bias: bool = True, gather_output: bool = False,
                 stride: int = 1, skip_bias_add: bool = False,
                 params_dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None,
                 gradient_accumulation_fusion: bool = False,
                 sequence_parallel: bool = False, use_cpu_initialization: bool = True,
                 perform_initialization: bool = True, explicit_expert_comm: bool = False) -> None:
        super().__init__()
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel needs gather_output=False")
        if explicit_expert_comm and (sequence_parallel or gather_output):
            raise ValueError("ColumnParallelLinear: explicit_expert_comm communicates nothing "
                             "(no sequence_parallel, no gather_output)")
        self.tp_group = tp_group
        self.comm_group = None if explicit_expert_comm else tp_group
        self.sequence_parallel = sequence_parallel
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, tp_world_size(tp_group))
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.stride = stride
        self.weight = _init_sharded_weight((output_size, input_size), 0, stride, init_method,
                                           tp_group, params_dtype, device,
                                           use_cpu_initialization, perform_initialization)
        self.bias = None
        if bias:
            self.bias = _zero_bias(self.output_size_per_partition, params_dtype, device)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [..., in]`` (``[s/p, b, in]`` with sequence parallelism) -> (``[..., out/p]``
        or gathered ``[..., out]``, skipped bias)."""
        bias = None if self.skip_bias_add else self.bias
        out = column_parallel_linear(x, self.weight, bias, self.comm_group,
                                     self.gradient_accumulation_fusion,
                                     self.sequence_parallel)  # [..., out/p]
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, self.tp_group)  # [..., out]
            # The shards concatenate rank-major; strided shards need their blocks put back.
            out = _swap_stride_blocks(out, tp_world_size(self.tp_group), self.stride)
        return out, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, "
                f"out_per_partition={self.output_size_per_partition}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(torch.nn.Module):
    """``Y = X A + b`` with ``A`` split along its input dimension and ``X`` along its last.

    The partial products are all-reduced (*g*), then the (replicated) bias is added once.

    Args:
        input_size: ``in`` of the full layer (divisible by the TP size).
        output_size: ``out`` of the full layer.
        tp_group: the TP process group (``None`` = this rank alone: no tensor parallelism).
        init_method: in-place initializer of the full ``[out, in]`` weight.
        bias: add a bias (replicated on all TP ranks, zero-initialized).
        input_is_parallel: the input is already split (the output of a column-parallel layer,
            strided as the weight when ``stride`` > 1); otherwise it is scattered here.
        stride: interleaving of the input split (rank r holds blocks r, r + p, ... of
            ``p * stride``).
        skip_bias_add: return the bias instead of adding it.
        params_dtype: dtype of the parameters.
        device: where parameters live.
        gradient_accumulation_fusion: accumulate the weight gradient straight into
            ``weight.main_grad`` when the DDP wrapper gave it one.
        sequence_parallel: reduce-scatter the partial sums along the sequence instead of
            all-reducing them: ``[s, b, in/p]`` -> ``[s/p, b, out]`` (sequence parallelism).
            The bias is then added on this rank's rows only, so its gradient is partial and is
            marked ``sequence_parallel`` (summed over TP ranks by ``finalize_model_grads``).
        use_cpu_initialization, perform_initialization, explicit_expert_comm: as
            :class:`ColumnParallelLinear`'s (the partial sums are returned unreduced).
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group: ProcessGroup | None,
                 init_method: InitMethod, bias: bool = True, input_is_parallel: bool = False,
                 stride: int = 1, skip_bias_add: bool = False,
                 params_dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None,
                 gradient_accumulation_fusion: bool = False,
                 sequence_parallel: bool = False, use_cpu_initialization: bool = True,
                 perform_initialization: bool = True, explicit_expert_comm: bool = False) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        if explicit_expert_comm and (sequence_parallel or not input_is_parallel):
            raise ValueError("RowParallelLinear: explicit_expert_comm communicates nothing "
                             "(input_is_parallel, no sequence_parallel)")
        self.tp_group = tp_group
        self.comm_group = None if explicit_expert_comm else tp_group
        self.sequence_parallel = sequence_parallel
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, tp_world_size(tp_group))
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.stride = stride
        self.weight = _init_sharded_weight((output_size, input_size), 1, stride, init_method,
                                           tp_group, params_dtype, device,
                                           use_cpu_initialization, perform_initialization)
        self.bias = None
        if bias:
            self.bias = _zero_bias(output_size, params_dtype, device)
            set_tensor_model_parallel_attributes(self.bias, False, -1, 1)
            set_sequence_parallel_attribute(self.bias, sequence_parallel)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [..., in/p]`` (or ``[..., in]``) -> (``[..., out]``, skipped bias or None)."""
        if not self.input_is_parallel:
            # Rank-major block order first, so the contiguous scatter matches strided weights.
            x = _swap_stride_blocks(x, self.stride, tp_world_size(self.tp_group))
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)  # [..., in/p]
        out = _linear(x, self.weight, None,
                      self.gradient_accumulation_fusion)  # partial sums [..., out]
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(out, self.tp_group)  # [s/p, b, out]
        else:
            out = reduce_from_tensor_model_parallel_region(out, self.comm_group, in_place=True)
        if self.skip_bias_add or self.bias is None:
            return out, self.bias
        return out + self.bias, None

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, "
                f"in_per_partition={self.input_size_per_partition}")


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split along the vocabulary: rank r holds ids ``[r V/p, (r+1) V/p)``.

    Ids outside this rank's range look up row 0 and are zeroed; the all-reduce then sums the one
    rank that holds each id with zeros from the others.

    Args:
        num_embeddings: (padded) vocabulary size, divisible by the TP size.
        embedding_dim: hidden size.
        tp_group: the TP process group.
        init_method: in-place initializer of the full ``[V, h]`` table.
        params_dtype: dtype of the table.
        device: where it lives.
        reduce_scatter_embeddings: ``ids [b, s]`` -> this rank's ``[s/p, b, h]`` (sequence
            parallelism): the lookup is transposed to ``[s, b, h]`` and its partial sums
            reduce-scattered along the sequence instead of all-reduced.
        use_cpu_initialization, perform_initialization: as :class:`ColumnParallelLinear`'s.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: ProcessGroup | None,
                 init_method: InitMethod, params_dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None,
                 reduce_scatter_embeddings: bool = False, use_cpu_initialization: bool = True,
                 perform_initialization: bool = True) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = divide(num_embeddings, tp_world_size(tp_group))
        self.vocab_start_index, self.vocab_end_index = vocab_range(
            self.num_embeddings_per_partition, tp_rank(tp_group))
        self.weight = _init_sharded_weight((num_embeddings, embedding_dim), 0, 1, init_method,
                                           tp_group, params_dtype, device,
                                           use_cpu_initialization, perform_initialization)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [...]`` (int) -> ``[..., h]``; with ``reduce_scatter_embeddings``
        ``ids [b, s]`` -> ``[s/p, b, h]``."""
        if tp_world_size(self.tp_group) == 1:
            out = F.embedding(ids, self.weight)
            return out.transpose(0, 1).contiguous() if self.reduce_scatter_embeddings else out
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight)  # [..., h]
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            out = out.transpose(0, 1).contiguous()  # [s, b, h] partial sums
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)  # [s/p, b, h]
        return reduce_from_tensor_model_parallel_region(out, self.tp_group, in_place=True)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"per_partition={self.num_embeddings_per_partition}")
