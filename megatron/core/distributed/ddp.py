"""Data-parallel wrappers: Megatron's local DDP (``--DDP-impl local``) and PyTorch's (``torch``).

The training loop uses either wrapper through the same methods::

    model = DistributedDataParallel(module, DistributedDataParallelConfig(), dp_group=dp_group)
    model.zero_grad_buffer()                 # start of every iteration
    with model.no_sync():                    # micro-batches before the last
        loss(model(batch)).backward()
    loss(model(last_batch)).backward()      # with --overlap-grad-reduce buckets launch here
    model.finish_grad_sync()                 # (finalize_model_grads calls this)
    # every param.main_grad now holds the DP-averaged gradient (or, with the distributed
    # optimizer, this rank's shard of it does)

Local DDP: one contiguous gradient buffer per gradient dtype (fp32 for every parameter with
``accumulate_allreduce_grads_in_fp32``, else the parameter's dtype), ``param.main_grad`` a view into
it (:mod:`megatron.core.distributed.grad_buffer`). A hook after each parameter's gradient
accumulation adds ``param.grad`` into ``main_grad`` and frees ``param.grad``, so micro-batches
accumulate in the buffer. ``start_grad_sync``/``finish_grad_sync`` average the buffer over the
data-parallel group: all-reduce, or reduce-scatter with the distributed optimizer. With
``overlap_grad_reduce`` a bucket's collective is launched asynchronously as soon as all its
gradients of the last micro-batch are in, and ``finish_grad_sync`` waits for them.

``--no-contiguous-buffers-in-local-ddp`` keeps the gradients in ``param.grad`` instead and
all-reduces them per dtype at ``finish_grad_sync`` through a temporary flattened copy (Megatron-LM
23.06's non-contiguous path); ``main_grad`` is then ``param.grad`` itself.

After a distributed-optimizer step the buffer's memory is reused to all-gather the parameters, so
``zero_grad_buffer()`` must run before the next backward (the training loop does it every
iteration, as Megatron-LM's does).

With ``check_for_nan_in_grad`` each bucket's local gradients are checked for NaN/inf just before
its data-parallel reduction (as Megatron-Core's DDP does), so that the rank where they first went
non-finite can be named; ``local_grads_finite()`` reads the result. The check only records: the
training loop decides, for every rank at once, whether to stop (raising on one rank would leave
the others waiting in the next collective).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from megatron.core import comm
from megatron.core.distributed.config import DistributedDataParallelConfig
from megatron.core.distributed.grad_buffer import GradBuffer

# 4M elements: 16 MB fp32 / 8 MB bf16 buckets, the size range gloo reduces fastest
# (PERF_NOTES.md); Megatron-LM's NCCL default is 40M.
DEFAULT_BUCKET_SIZE = 4_000_000


class _WeakGradHook:
    """The parameters' post-accumulate-grad hook, holding the wrapper weakly. A parameter that
    autograd's C++ side references is not traversed by the garbage collector, so a bound
    method there (parameter -> hook -> wrapper -> module -> parameter) kept every discarded
    model, its gradient buffers and optimizer alive for the life of the process (in-process
    runs one after another: tests, ``bench/gpu_speed.py``'s sides)."""

    __slots__ = ("_wrapper",)

    def __init__(self, wrapper: "DistributedDataParallel") -> None:
        self._wrapper = weakref.ref(wrapper)

    def __call__(self, param: torch.nn.Parameter) -> None:
        wrapper = self._wrapper()
        if wrapper is None:
            # The gradient would stay in param.grad, outside the buffers the optimizer reads.
            raise RuntimeError("a backward pass reached a parameter whose DistributedDataParallel "
                               "wrapper was discarded: keep the wrapper the model was trained with")
        wrapper._grad_hook(param)


class _ModuleStateDict(torch.nn.Module):
    """State dict (and pipeline input) passthrough for a wrapper with a ``module``: checkpoints
    hold the bare module's keys, whichever wrapper trained it."""

    module: torch.nn.Module

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """The activation from the previous pipeline stage, handed to the wrapped chunk (the
        pipeline schedules call this on what they were given: the wrapper)."""
        self.module.set_input_tensor(input_tensor)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.module.state_dict(*args, **kwargs)

    def state_dict_for_save_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The module's ``state_dict_for_save_checkpoint`` (Megatron's nested keys) if any."""
        inner = getattr(self.module, "state_dict_for_save_checkpoint", None)
        return inner(*args, **kwargs) if inner else self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict)


def _nonfinite(grads: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor (no host sync): does ``grads`` hold a NaN or an inf?"""
    # One sum is NaN/inf iff an element is (or the sum overflows, which only gradients near the
    # dtype's limit do); half precision is summed in fp32 so that it cannot overflow.
    wide = torch.float32 if grads.dtype in (torch.float16, torch.bfloat16) else grads.dtype
    return ~torch.isfinite(grads.sum(dtype=wide))


class DistributedDataParallel(_ModuleStateDict):
    """Megatron's local data-parallel wrapper with contiguous, bucketed gradient buffers.

    Args:
        module: the model (chunk) to wrap.
        config: buffers, their reduction and the checks before it.
        dp_group: the data-parallel group gradients are averaged over (None: this rank
            alone, nothing to average).
        bucket_size: elements per bucket when overlapping (None: one bucket per buffer);
            without overlap each buffer is one bucket, as in Megatron-LM.
        expert_dp_group: with expert parallelism, the expert-data-parallel group: the
            parameters marked ``allreduce = False`` (the MoE experts) get their own buffers,
            reduced over it (Megatron's expert buffers); None: every parameter in the dense
            buffers.
    """

    def __init__(self, module: torch.nn.Module, config: DistributedDataParallelConfig, *,
                 dp_group: comm.ProcessGroup | None,
                 bucket_size: int | None = DEFAULT_BUCKET_SIZE,
                 expert_dp_group: comm.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        self.dp_group = dp_group
        self.expert_dp_group = expert_dp_group
        self.accumulate_allreduce_grads_in_fp32 = config.accumulate_allreduce_grads_in_fp32
        self.overlap_grad_reduce = config.overlap_grad_reduce
        self.use_distributed_optimizer = config.use_distributed_optimizer
        self.bucket_size = bucket_size if config.overlap_grad_reduce else None
        self._is_last_microbatch = True
        self.use_contiguous_buffers = config.use_contiguous_buffers_in_local_ddp
        self.check_for_nan_in_grad = config.check_for_nan_in_grad
        self._nonfinite: torch.Tensor | None = None  # any local grad non-finite this iteration
        self._params = [p for p in module.parameters() if p.requires_grad]
        self.grad_buffers: dict[torch.dtype, GradBuffer] = {}
        self.expert_grad_buffers: dict[torch.dtype, GradBuffer] = {}
        self.param_to_grad_buffer: dict[torch.nn.Parameter, GradBuffer] = {}
        self._hooks = []
        if self.use_contiguous_buffers:
            self._build_grad_buffers()

    def _build_grad_buffers(self) -> None:
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        expert_by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for param in self._params:
            expert = self.expert_dp_group is not None and not getattr(param, "allreduce", True)
            (expert_by_dtype if expert else by_dtype).setdefault(
                self._grad_dtype(param), []).append(param)
        self.grad_buffers = {
            dtype: GradBuffer(params, dtype, self.dp_group, self.bucket_size,
                              self.use_distributed_optimizer)
            for dtype, params in by_dtype.items()}
        self.expert_grad_buffers = {
            dtype: GradBuffer(params, dtype, self.expert_dp_group, self.bucket_size,
                              self.use_distributed_optimizer,
                              average_over=comm.world_size(self.dp_group))
            for dtype, params in expert_by_dtype.items()}
        self.param_to_grad_buffer = {p: buf for buf in self.all_grad_buffers()
                                     for p in buf.params}
        hook = _WeakGradHook(self)
        self._hooks = [p.register_post_accumulate_grad_hook(hook)
                       for p in self.param_to_grad_buffer]

    def all_grad_buffers(self) -> list[GradBuffer]:
        """The dense buffers, then the expert buffers."""
        return [*self.grad_buffers.values(), *self.expert_grad_buffers.values()]

    def _grad_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return torch.float32 if self.accumulate_allreduce_grads_in_fp32 else param.dtype

    def _grad_hook(self, param: torch.nn.Parameter) -> None:
        # Runs once per backward after autograd summed every use of the param (tied weights too).
        if param.grad is not None:
            param.main_grad.add_(param.grad)
            param.grad = None  # the buffer is the only copy that survives the micro-batch
        if self.overlap_grad_reduce and self._is_last_microbatch:
            bucket = self.param_to_grad_buffer[param].param_to_bucket[param]
            if bucket.register_grad_ready(param):
                self._start_bucket(bucket, async_op=True)

    def _start_bucket(self, bucket, async_op: bool) -> None:
        """Launch ``bucket``'s reduction, checking its local gradients first if asked to."""
        if self.check_for_nan_in_grad:
            self._record_finite(bucket.data)
        bucket.start_grad_sync(async_op=async_op)

    def _record_finite(self, grads: torch.Tensor) -> None:
        bad = _nonfinite(grads)
        self._nonfinite = bad if self._nonfinite is None else self._nonfinite | bad

    def local_grads_finite(self) -> bool:
        """Whether every gradient this rank produced this iteration was finite before the
        data-parallel reduction (True when ``check_for_nan_in_grad`` is off)."""
        return self._nonfinite is None or not bool(self._nonfinite)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Give every replica data-parallel rank 0's parameters. With
        ``--data-parallel-random-init`` each DP rank seeds differently and so initializes
        differently; Megatron-LM then broadcasts once, so that only the RNG streams (dropout)
        stay per-rank and the replicas train the same weights."""
        if comm.world_size(self.dp_group) == 1:
            return
        src = comm.global_rank(self.dp_group, 0)
        for param in self.module.parameters():
            if self.expert_dp_group is not None and not getattr(param, "allreduce", True):
                if comm.world_size(self.expert_dp_group) > 1:  # each EP rank's own experts
                    comm.broadcast(param.data, comm.global_rank(self.expert_dp_group, 0),
                                   self.expert_dp_group)
                continue
            comm.broadcast(param.data, src, self.dp_group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches run inside do not launch gradient reductions (only accumulate)."""
        self._is_last_microbatch = False
        try:
            yield
        finally:
            self._is_last_microbatch = True

    def zero_grad_buffer(self) -> None:
        """Zero every gradient buffer and reset the buckets (start of an iteration)."""
        for param in self._params:
            param.grad = None
            if not self.use_contiguous_buffers:
                param.main_grad = None
        for buffer in self.all_grad_buffers():
            buffer.reset()
        self._nonfinite = None

    def start_grad_sync(self) -> None:
        """Launch the reduction of every bucket not launched yet (asynchronously if overlapping)."""
        for buffer in self.all_grad_buffers():
            for bucket in buffer.buckets:
                if not bucket.started:
                    self._start_bucket(bucket, async_op=self.overlap_grad_reduce)

    def finish_grad_sync(self) -> None:
        """Complete the DP reduction: afterwards ``main_grad`` holds the averaged gradients."""
        if not self.use_contiguous_buffers:
            self._allreduce_param_grads()
            return
        for buffer in self.all_grad_buffers():
            for bucket in buffer.buckets:
                if not bucket.started:
                    self._start_bucket(bucket, async_op=False)
                bucket.finish_grad_sync()

    def _allreduce_param_grads(self) -> None:
        """Without the buffer: average ``param.grad`` per dtype through one flattened copy."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in self._params:
            if param.grad is not None:
                by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
            param.main_grad = param.grad
        if self.check_for_nan_in_grad:
            for grads in by_dtype.values():
                for grad in grads:
                    self._record_finite(grad)
        if comm.world_size(self.dp_group) == 1:
            return
        for grads in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(grads)
            flat.div_(comm.world_size(self.dp_group))  # before the sum: fp16 range
            comm.all_reduce(flat, self.dp_group, "sum")
            for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)

    def grad_sync_started(self) -> bool:
        """True once any bucket's reduction has been launched this iteration."""
        return any(b.started for buf in self.all_grad_buffers() for b in buf.buckets)


class TorchDistributedDataParallel(_ModuleStateDict):
    """``--DDP-impl torch``: PyTorch's DDP behind the local wrapper's methods.

    PyTorch reduces during backward, so ``finish_grad_sync`` only exposes ``param.grad`` as
    ``param.main_grad``. The distributed optimizer and fp32 grad accumulation need the local DDP.

    Args:
        module: the model (chunk) to wrap.
        dp_group: the data-parallel group gradients are averaged over; a real group, since
            PyTorch's DDP would read None as the whole world.
        bucket_size: elements per bucket (converted to PyTorch's ``bucket_cap_mb``).
        check_for_nan_in_grad: record whether the gradients are finite; PyTorch reduces them
            inside backward, so they are checked after the reduction (every replica agrees).

    Raises:
        ValueError: ``dp_group`` is None.
    """

    def __init__(self, module: torch.nn.Module, *, dp_group: comm.ProcessGroup,
                 bucket_size: int | None = DEFAULT_BUCKET_SIZE,
                 check_for_nan_in_grad: bool = False) -> None:
        super().__init__()
        if dp_group is None:
            raise ValueError("--DDP-impl torch needs a data-parallel process group (None is this "
                             "rank alone); pass parallel_state.get_data_parallel_group()")
        kwargs = {}
        if bucket_size is not None:
            kwargs["bucket_cap_mb"] = bucket_size * 4 / 2**20
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            module, process_group=dp_group, **kwargs)
        self.module = module
        self.use_distributed_optimizer = False
        self.overlap_grad_reduce = True
        self.check_for_nan_in_grad = check_for_nan_in_grad
        self._nonfinite: torch.Tensor | None = None
        self._dp_group = dp_group
        # Whether PyTorch's DDP will reduce this step's gradients itself (see forward).
        self._reducing_forward = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # PyTorch's DDP arms its reduction in forward, not in backward: a micro-batch whose
        # forward ran under no_sync() is never reduced, even if sync is on again for its
        # backward. Pipeline schedules run every forward under no_sync (the last backward of a
        # chunk comes after later forwards), so finish_grad_sync reduces those steps itself.
        self._reducing_forward = torch.is_grad_enabled() and self.ddp.require_backward_grad_sync
        return self.ddp(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.ddp.no_sync()

    def zero_grad_buffer(self) -> None:
        for param in self.module.parameters():
            param.grad = None
            param.main_grad = None
        self._nonfinite = None

    def start_grad_sync(self) -> None:
        """Nothing to do: PyTorch's DDP reduces during backward."""

    def finish_grad_sync(self) -> None:
        """Expose the reduced ``param.grad`` as ``param.main_grad`` (reducing it here when
        PyTorch's DDP did not: see :meth:`forward`)."""
        reduce_here = not self._reducing_forward
        self._reducing_forward = False
        for param in self.module.parameters():
            if reduce_here and param.grad is not None:
                comm.all_reduce(param.grad, self._dp_group, op="avg")
            param.main_grad = param.grad
            if self.check_for_nan_in_grad and param.grad is not None:
                bad = _nonfinite(param.grad)
                self._nonfinite = bad if self._nonfinite is None else self._nonfinite | bad

    def local_grads_finite(self) -> bool:
        """Whether every (already reduced) gradient was finite (True when not checking)."""
        return self._nonfinite is None or not bool(self._nonfinite)

    def grad_sync_started(self) -> bool:
        return True
