"""Forward/backward schedules over the micro-batches of one global batch.

Contract (Megatron's): ``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)``
and ``loss_func(output_tensor) -> (loss, {name: value reduced over data-parallel ranks})``. The
schedule divides each micro-batch's loss by the number of micro-batches (so gradients accumulate to
the mean), scales it with ``grad_scale_func`` (the fp16 loss scale) before backward, and returns
the list of reduced-loss dicts, one per micro-batch. Given ``timers``, it times Megatron-LM's
level-2 ``forward-compute``, ``backward-compute`` and ``batch-generator`` (each ``next()`` on the
data iterator), and the pipelined schedules the send/receive timers of
:mod:`megatron.core.pipeline_parallel.p2p_communication`.

Pipelined schedules (``--pipeline-model-parallel-size > 1``): ``model`` is the list of this rank's
model chunks (one, or one per virtual stage). A chunk that is not the pipeline's first receives
its input through ``set_input_tensor`` before ``forward_step_func`` runs; a chunk that is not the
last returns the hidden ``[s, b, h]``, which is sent on. The loss function runs on the last stage
only, and only the last stage returns the reduced-loss dicts (other stages return ``[]``).

Data-parallel gradient reduction: every chunk runs inside its ``no_sync()`` until just before its
last micro-batch's backward, which then launches the reduction (with ``--overlap-grad-reduce``,
bucket by bucket while that backward still runs; the earlier chunks' reductions overlap the later
chunks' backwards in the interleaved schedule). ``finalize_model_grads`` completes them. This
relies on the wrapper deciding at backward time (the local DDP does); PyTorch's DDP decides at
forward time, so its wrapper must reduce in ``finish_grad_sync`` instead.

Legend: s = sequence length, b = micro-batch size, h = hidden size; m = micro-batches,
p = pipeline stages, v = model chunks (virtual stages) per rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from megatron.core import device, parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, Shape
from megatron.core.timers import Timers, timed
from megatron.core.transformer.moe.moe_utils import set_aux_loss_scale

ForwardStepFunc = Callable


def get_forward_backward_func() -> Callable:
    """The schedule for the current parallel layout (the one place schedules are chosen)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return forward_backward_no_pipelining
    virtual = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if virtual is not None and virtual > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving


class _TimedIterator:
    """``next()`` of the wrapped iterator timed as ``batch-generator``."""

    def __init__(self, iterator: Iterator, timers: Timers) -> None:
        self.iterator, self.timers = iterator, timers

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self):
        with timed(self.timers, "batch-generator", 2):
            return next(self.iterator)


def _active_timers(timers: Timers | None) -> Timers | None:
    # Nothing to record below level 2: skip the per-micro-batch timing work altogether.
    return timers if timers is not None and timers.active(2) else None


def _timed_iterator(iterator, timers: Timers | None):
    return _TimedIterator(iterator, timers) if timers is not None and iterator is not None \
        else iterator


def _forward_step(forward_step_func: ForwardStepFunc, data_iterator, model,
                  num_microbatches: int, store: list, collect_non_loss_data: bool,
                  timers: Timers | None = None) -> torch.Tensor:
    with timed(timers, "forward-compute", 2):  # the loss function included, as Megatron's
        output_tensor, loss_func = forward_step_func(data_iterator, model)
        return _apply_loss(output_tensor, loss_func, num_microbatches, store,
                           collect_non_loss_data)


def _apply_loss(output_tensor: torch.Tensor, loss_func: Callable, num_microbatches: int,
                store: list, collect_non_loss_data: bool) -> torch.Tensor:
    if collect_non_loss_data:
        store.append(loss_func(output_tensor, non_loss_data=True))
        return output_tensor
    loss, reduced = loss_func(output_tensor)
    store.append(reduced)
    return loss / num_microbatches


def _set_aux_loss_scale(grad_scale_func: Callable | None, num_microbatches: int) -> None:
    """The MoE routers' auxiliary losses join the backward pass with the main loss's scale:
    the fp16 loss scale times the context-parallel size over the number of micro-batches
    (Megatron's schedules set ``MoEAuxLossAutoScaler``'s scale the same way). The CP factor:
    each CP rank's loss is its share of the sequences' loss, and the gradients are averaged
    over DP x CP."""
    cp = parallel_state.get_context_parallel_world_size()
    if grad_scale_func is None:
        set_aux_loss_scale(cp / num_microbatches)
        return
    # The loss scaler's scale stays a device tensor: reading its value would make every step
    # wait for the device.
    one = torch.ones((), device=device.get_device())
    set_aux_loss_scale(grad_scale_func(one) * cp / num_microbatches)


def _backward_step(loss: torch.Tensor, grad_scale_func: Callable | None,
                   timers: Timers | None = None) -> None:
    with timed(timers, "backward-compute", 2):
        if grad_scale_func is not None:
            loss = grad_scale_func(loss)
        torch.autograd.backward(loss)


def forward_backward_no_pipelining(*, forward_step_func: ForwardStepFunc,
                                   data_iterator: Iterator | list[Iterator],
                                   model: torch.nn.Module | list[torch.nn.Module],
                                   num_microbatches: int, seq_length: int | None = None,
                                   micro_batch_size: int | None = None,
                                   forward_only: bool = False,
                                   collect_non_loss_data: bool = False,
                                   grad_scale_func: Callable | None = None,
                                   timers: Timers | None = None,
                                   variable_seq_lengths: bool = False) -> list:
    """Run every micro-batch forward then backward on one model chunk.

    Gradient reduction across data-parallel ranks is suppressed (``model.no_sync()``) for all but
    the last micro-batch, so an overlapping DDP reduces each bucket once per step. The shape
    arguments of the pipelined schedules (``seq_length``, ``micro_batch_size``,
    ``variable_seq_lengths``) are accepted and unused, so a caller passes the same arguments
    whatever :func:`get_forward_backward_func` returned.

    Returns:
        One entry per micro-batch: the loss function's reduced-loss dict.
    """
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("non-pipelined schedule runs exactly one model chunk")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    _set_aux_loss_scale(grad_scale_func, num_microbatches)
    timers = _active_timers(timers)
    data_iterator = _timed_iterator(data_iterator, timers)
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    store: list = []
    grad_context = torch.no_grad() if forward_only else contextlib.nullcontext()
    with grad_context:
        with no_sync():
            for _ in range(num_microbatches - 1):
                loss = _forward_step(forward_step_func, data_iterator, model, num_microbatches,
                                     store, collect_non_loss_data, timers)
                if not forward_only:
                    _backward_step(loss, grad_scale_func, timers)
        loss = _forward_step(forward_step_func, data_iterator, model, num_microbatches, store,
                             collect_non_loss_data, timers)
        if not forward_only:
            _backward_step(loss, grad_scale_func, timers)
    return store


# Pipelined schedules ---------------------------------------------------------------------------
def _unwrapped_config(chunk: torch.nn.Module):
    """The transformer config of a (possibly wrapped) model chunk, or None."""
    module = chunk
    while module is not None:
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "hidden_size"):
            return config
        module = getattr(module, "module", None)
    return None


def _set_input_tensor_func(chunk: torch.nn.Module) -> Callable | None:
    """The chunk's ``set_input_tensor`` (looked up through wrappers lacking it), or None."""
    module = chunk
    while module is not None:
        setter = getattr(module, "set_input_tensor", None)
        if setter is not None:
            return setter
        module = getattr(module, "module", None)
    return None


def _tensor_shape(chunk: torch.nn.Module, seq_length: int | None,
                  micro_batch_size: int | None) -> Shape:
    """``(s, b, h)`` of the activations between stages: h from the chunk's transformer
    config, s split over CP (context parallelism) and over TP where that config asks for
    sequence parallelism."""
    config = _unwrapped_config(chunk)
    if config is None:
        raise ValueError("pipelined schedules need the activations' hidden size: give the "
                         "model chunk a config with hidden_size")
    if seq_length is None or micro_batch_size is None:
        raise ValueError("pipelined schedules need seq_length and micro_batch_size (the shape "
                         "of the tensors sent between stages)")
    seq_length //= getattr(config, "context_parallel_size", 1)
    if getattr(config, "sequence_parallel", False):
        seq_length //= parallel_state.get_tensor_model_parallel_world_size()
    return (seq_length, micro_batch_size, config.hidden_size)


def _pipeline_dtype(chunk: torch.nn.Module) -> torch.dtype:
    """Megatron's ``pipeline_dtype``: the parameters' dtype (fp32 with
    ``--fp32-residual-connection``, whose hidden states stay fp32)."""
    config = _unwrapped_config(chunk)
    if config is None:
        return torch.float32
    if getattr(config, "fp32_residual_connection", False):
        return torch.float32
    return getattr(config, "params_dtype", torch.float32)


class _GradSync:
    """Per-chunk ``no_sync()``: entered at the start, left just before the chunk's last backward
    (so that backward launches the chunk's data-parallel reduction), left for every chunk at the
    end whatever happened."""

    def __init__(self, chunks: list[torch.nn.Module], enabled: bool) -> None:
        self.contexts: dict[int, contextlib.AbstractContextManager] = {}
        if not enabled:
            return
        for index, chunk in enumerate(chunks):
            no_sync = getattr(chunk, "no_sync", None)
            if no_sync is not None:
                context = no_sync()
                context.__enter__()
                self.contexts[index] = context

    def enable(self, index: int) -> None:
        context = self.contexts.pop(index, None)
        if context is not None:
            context.__exit__(None, None, None)

    def enable_all(self) -> None:
        for index in list(self.contexts):
            self.enable(index)


class _Stages:
    """What both pipelined schedules share: the chunks, their iterators, the stored activations,
    one forward and one backward step."""

    def __init__(self, *, forward_step_func: ForwardStepFunc, data_iterators: list,
                 chunks: list[torch.nn.Module], num_microbatches: int, forward_only: bool,
                 collect_non_loss_data: bool, grad_scale_func: Callable | None,
                 timers: Timers | None, p2p: P2PCommunicator) -> None:
        self.forward_step_func = forward_step_func
        self.data_iterators = [_timed_iterator(it, timers) for it in data_iterators]
        self.chunks = chunks
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.grad_scale_func = grad_scale_func
        self.timers = timers
        self.p2p = p2p
        self.rank, self.size = p2p.rank, p2p.size
        self.store: list = []
        # Per chunk, in micro-batch order: inputs and outputs kept for the backward.
        self.inputs: list[list] = [[] for _ in chunks]
        self.outputs: list[list] = [[] for _ in chunks]
        self.grad_sync = _GradSync(chunks, enabled=not forward_only)

    def is_first(self, chunk_id: int) -> bool:
        """Does (this rank, ``chunk_id``) hold the pipeline's first virtual stage?"""
        return self.rank == 0 and chunk_id == 0

    def is_last(self, chunk_id: int) -> bool:
        return self.rank == self.size - 1 and chunk_id == len(self.chunks) - 1

    def select(self, chunk_id: int) -> None:
        # Lets the model ask parallel_state.is_pipeline_first_stage() per chunk.
        if len(self.chunks) > 1 and parallel_state.model_parallel_is_initialized():
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id)

    def forward(self, chunk_id: int, input_tensor: torch.Tensor | None) -> torch.Tensor:
        """One micro-batch through chunk ``chunk_id``: its output (the scaled loss on the last
        stage). The input and output are kept for :meth:`backward`."""
        self.select(chunk_id)
        chunk = self.chunks[chunk_id]
        with timed(self.timers, "forward-compute", 2):
            setter = _set_input_tensor_func(chunk)
            if setter is not None:
                setter(input_tensor)
            elif input_tensor is not None:
                raise ValueError(f"model chunk {chunk_id} ({type(chunk).__name__}) has no "
                                 "set_input_tensor: a pipeline stage cannot take its input")
            output_tensor, loss_func = self.forward_step_func(self.data_iterators[chunk_id],
                                                              chunk)
            if self.is_last(chunk_id):
                output_tensor = _apply_loss(output_tensor, loss_func, self.num_microbatches,
                                            self.store, self.collect_non_loss_data)
        if not self.forward_only:
            self.inputs[chunk_id].append(input_tensor)
            self.outputs[chunk_id].append(output_tensor)
        return output_tensor

    def backward(self, chunk_id: int, output_tensor_grad: torch.Tensor | None,
                 last_of_chunk: bool) -> torch.Tensor | None:
        """Backward of chunk ``chunk_id``'s oldest stored micro-batch; returns the gradient of
        its input (None on the first stage)."""
        self.select(chunk_id)
        if last_of_chunk:
            self.grad_sync.enable(chunk_id)
        input_tensor = self.inputs[chunk_id].pop(0)
        output_tensor = self.outputs[chunk_id].pop(0)
        with timed(self.timers, "backward-compute", 2):
            if output_tensor_grad is None and self.grad_scale_func is not None:
                output_tensor = self.grad_scale_func(output_tensor)  # the loss, last stage
            torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
        if input_tensor is None:
            return None
        if input_tensor.grad is None:
            # A stage that ignored its input still owes the previous stage a gradient: without
            # the send the previous stage would wait forever.
            return torch.zeros_like(input_tensor)
        return input_tensor.grad


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _communicator(p2p_communicator: P2PCommunicator | None, chunk: torch.nn.Module,
                  variable_seq_lengths: bool, timers: Timers | None) -> P2PCommunicator:
    if p2p_communicator is not None:
        return p2p_communicator
    return P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(),
                           dtype=_pipeline_dtype(chunk),
                           variable_seq_lengths=variable_seq_lengths, timers=timers)


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func: ForwardStepFunc, data_iterator: Iterator | list[Iterator],
        model: torch.nn.Module | list[torch.nn.Module], num_microbatches: int,
        seq_length: int | None = None, micro_batch_size: int | None = None,
        forward_only: bool = False, collect_non_loss_data: bool = False,
        grad_scale_func: Callable | None = None, timers: Timers | None = None,
        variable_seq_lengths: bool = False,
        p2p_communicator: P2PCommunicator | None = None) -> list:
    """1F1B: warm-up forwards, then one forward and one backward at a time, then cool-down
    backwards; stage ``r`` of ``p`` runs ``min(p - r - 1, m)`` warm-up forwards.

    Args:
        (as :func:`forward_backward_no_pipelining`, ``model`` one chunk whose ``config`` gives
        the hidden size, the dtype and sequence parallelism of the ``[s, b, h]`` tensors sent
        between stages), and:
        variable_seq_lengths: send each tensor's shape before it.
        p2p_communicator: the communicator to use (default: over this rank's pipeline group;
            the schedule-order tests pass one that records instead of sending).

    Returns:
        On the last stage the reduced-loss dicts, one per micro-batch; elsewhere ``[]``.
    """
    chunks = _as_list(model)
    if len(chunks) != 1:
        raise ValueError(f"the non-interleaved pipeline schedule runs one model chunk per rank, "
                         f"got {len(chunks)}")
    _set_aux_loss_scale(grad_scale_func, num_microbatches)
    timers = _active_timers(timers)
    p2p = _communicator(p2p_communicator, chunks[0], variable_seq_lengths, timers)
    shape = _tensor_shape(chunks[0], seq_length, micro_batch_size)
    run = _Stages(forward_step_func=forward_step_func,
                  data_iterators=_as_list(data_iterator)[:1], chunks=chunks,
                  num_microbatches=num_microbatches, forward_only=forward_only,
                  collect_non_loss_data=collect_non_loss_data, grad_scale_func=grad_scale_func,
                  timers=timers, p2p=p2p)
    grad_context = torch.no_grad() if forward_only else contextlib.nullcontext()
    try:
        with grad_context:
            _run_1f1b(run, shape)
    finally:
        run.grad_sync.enable_all()
    return run.store


def _run_1f1b(run: _Stages, shape: Shape) -> None:
    p2p, m = run.p2p, run.num_microbatches
    first, last = run.is_first(0), run.is_last(0)
    warmup = min(run.size - run.rank - 1, m)
    remaining = m - warmup

    def recv_forward():
        return None if first else p2p.recv_forward(shape)

    for _ in range(warmup):
        output_tensor = run.forward(0, recv_forward())
        if not last:
            p2p.send_forward(output_tensor)

    input_tensor = recv_forward() if remaining > 0 else None
    for i in range(remaining):
        last_iteration = i == remaining - 1
        output_tensor = run.forward(0, input_tensor)
        if run.forward_only:
            if not last:
                p2p.send_forward(output_tensor)
            if not last_iteration:
                input_tensor = recv_forward()
            continue
        output_tensor_grad = None if last else \
            p2p.send_forward_recv_backward(output_tensor, shape)
        input_tensor_grad = run.backward(0, output_tensor_grad,
                                         last_of_chunk=warmup == 0 and last_iteration)
        if last_iteration:
            if not first:
                p2p.send_backward(input_tensor_grad)
        elif not first:
            input_tensor = p2p.send_backward_recv_forward(input_tensor_grad, shape)

    if run.forward_only:
        return
    for i in range(warmup):  # cool-down: the warm-up micro-batches' backwards
        output_tensor_grad = None if last else p2p.recv_backward(shape)
        input_tensor_grad = run.backward(0, output_tensor_grad, last_of_chunk=i == warmup - 1)
        if not first:
            p2p.send_backward(input_tensor_grad)


def forward_backward_pipelining_with_interleaving(
        *, forward_step_func: ForwardStepFunc, data_iterator: list[Iterator],
        model: list[torch.nn.Module], num_microbatches: int, seq_length: int | None = None,
        micro_batch_size: int | None = None, forward_only: bool = False,
        collect_non_loss_data: bool = False, grad_scale_func: Callable | None = None,
        timers: Timers | None = None, variable_seq_lengths: bool = False,
        p2p_communicator: P2PCommunicator | None = None) -> list:
    """Interleaved 1F1B over ``v`` model chunks per rank (virtual stages ``c * p + r``).

    Micro-batches go through the chunks in groups of ``p``: forward number ``k`` runs chunk
    ``(k mod p·v) // p``, backward number ``k`` the mirror chunk. Stage ``r`` runs
    ``(p - r - 1)·2 + (v - 1)·p`` warm-up forwards (all of them when m = p, or forward-only),
    then alternates, then drains the backwards. Chunk ``k`` runs with
    ``parallel_state.set_virtual_pipeline_model_parallel_rank(k)`` set and is given
    ``data_iterator[k]``.

    Args: as :func:`forward_backward_pipelining_without_interleaving`; ``model`` and
        ``data_iterator`` are lists, one entry per chunk.

    Raises:
        ValueError: m is not a multiple of p (Megatron's condition), or the lists' lengths
            differ.
    """
    chunks = _as_list(model)
    iterators = _as_list(data_iterator)
    if len(iterators) != len(chunks):
        raise ValueError(f"the interleaved schedule needs one data iterator per model chunk: "
                         f"{len(chunks)} chunks, {len(iterators)} iterators")
    timers = _active_timers(timers)
    p2p = _communicator(p2p_communicator, chunks[0], variable_seq_lengths, timers)
    if num_microbatches % p2p.size != 0:
        raise ValueError(
            f"number of micro-batches ({num_microbatches}) is not divisible by "
            f"--pipeline-model-parallel-size ({p2p.size}), which the interleaved schedule "
            "(--num-layers-per-virtual-pipeline-stage) needs: change --global-batch-size or "
            "--micro-batch-size")
    _set_aux_loss_scale(grad_scale_func, num_microbatches)
    shape = _tensor_shape(chunks[0], seq_length, micro_batch_size)
    run = _Interleaved(forward_step_func=forward_step_func, data_iterators=iterators,
                       chunks=chunks, num_microbatches=num_microbatches,
                       forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
                       grad_scale_func=grad_scale_func, timers=timers, p2p=p2p)
    grad_context = torch.no_grad() if forward_only else contextlib.nullcontext()
    try:
        with grad_context:
            run.run(shape)
    finally:
        run.grad_sync.enable_all()
        run.select(0)
    return run.store


def interleaved_warmup_microbatches(pp_size: int, pp_rank: int, num_chunks: int,
                                    num_microbatches: int, forward_only: bool = False) -> int:
    """Forwards stage ``pp_rank`` runs before its first backward in the interleaved schedule."""
    total = num_microbatches * num_chunks
    if forward_only or num_microbatches == pp_size:
        return total  # every forward first: with m = p there is no steady state to fill
    return min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * pp_size, total)


class _Interleaved(_Stages):
    """Megatron's interleaved schedule without p2p overlap (``--overlap-p2p-communication``
    is not supported)."""

    def chunk_id(self, k: int, forward: bool) -> int:
        """Chunk of forward (or backward) number ``k``."""
        v = len(self.chunks)
        chunk = (k % (self.size * v)) // self.size
        return chunk if forward else v - 1 - chunk

    def last_backward_of_chunk(self, k: int) -> bool:
        group = self.size * len(self.chunks)
        total = self.num_microbatches * len(self.chunks)
        return k // group == total // group - 1 and (k % group) % self.size == self.size - 1

    def forward_k(self, k: int) -> torch.Tensor | None:
        """Forward number ``k``; returns what to send on (None from the last stage)."""
        chunk = self.chunk_id(k, forward=True)
        input_tensor = None if self.is_first(chunk) else self.pending_inputs[chunk].pop(0)
        output_tensor = self.forward(chunk, input_tensor)
        return None if self.is_last(chunk) else output_tensor

    def backward_k(self, k: int) -> torch.Tensor | None:
        """Backward number ``k``; returns the input gradient to send back (None from the first
        stage)."""
        chunk = self.chunk_id(k, forward=False)
        grad = None if self.is_last(chunk) else self.output_grads[chunk].pop(0)
        input_grad = self.backward(chunk, grad, self.last_backward_of_chunk(k))
        return None if self.is_first(chunk) else input_grad

    def run(self, shape: Shape) -> None:
        v = len(self.chunks)
        self.total = self.num_microbatches * v
        self.warmup = interleaved_warmup_microbatches(self.size, self.rank, v,
                                                      self.num_microbatches, self.forward_only)
        self.remaining = self.total - self.warmup
        self.all_warmup = not self.forward_only and self.num_microbatches == self.size
        self.pending_inputs: list[list] = [[] for _ in self.chunks]  # received, not run yet
        self.output_grads: list[list] = [[] for _ in self.chunks]
        if not self.is_first(0):
            self.pending_inputs[0].append(self.p2p.recv_forward(shape))
        self.run_warmup(shape)
        self.run_steady(shape)
        if not self.forward_only:
            self.run_cooldown(shape)

    def run_warmup(self, shape: Shape) -> None:
        v, last_rank = len(self.chunks), self.size - 1
        for k in range(self.warmup):
            output_tensor = self.forward_k(k)
            next_chunk = self.chunk_id(k + 1, forward=True)
            # The first rank's chunk 0 reads data, it receives nothing.
            recv_prev = not (self.rank == 0 and next_chunk == 0) and k != self.total - 1
            if k == self.warmup - 1 and not self.forward_only and not self.all_warmup:
                # The first backward (of the last chunk) comes next: fetch its gradient too.
                recv_next = self.rank != last_rank
                input_tensor, grad = self.p2p.send_forward_backward_recv_forward_backward(
                    output_tensor, None, recv_prev, recv_next, shape)
                if recv_next:
                    self.output_grads[v - 1].append(grad)
            else:
                input_tensor = self.p2p.send_forward_recv_forward(output_tensor, recv_prev,
                                                                  shape)
            if recv_prev:
                self.pending_inputs[next_chunk].append(input_tensor)

    def run_steady(self, shape: Shape) -> None:
        p, v = self.size, len(self.chunks)
        for i in range(self.remaining):
            forward_k, backward_k = i + self.warmup, i
            output_tensor = self.forward_k(forward_k)
            input_grad = self.backward_k(backward_k)
            if self.rank == 0:
                # The first stage runs p - 1 forwards ahead of the last: its next input comes
                # from the chunk the last stage is running now.
                next_forward = self.chunk_id(forward_k - (p - 1), forward=True) + 1
                recv_prev = next_forward != v
            else:
                next_forward, recv_prev = self.chunk_id(forward_k + 1, forward=True), True
            if self.rank == p - 1:
                next_backward = self.chunk_id(backward_k - (p - 1), forward=False) - 1
                recv_next = next_backward != -1
            else:
                next_backward, recv_next = self.chunk_id(backward_k + 1, forward=False), True
            if i == self.remaining - 1:
                recv_prev = False  # every forward's input has arrived
            input_tensor, grad = self.p2p.send_forward_backward_recv_forward_backward(
                output_tensor, input_grad, recv_prev, recv_next, shape)
            if recv_prev:
                self.pending_inputs[next_forward].append(input_tensor)
            if recv_next:
                self.output_grads[next_backward].append(grad)

    def run_cooldown(self, shape: Shape) -> None:
        v = len(self.chunks)
        if self.all_warmup and self.rank != self.size - 1:
            # m = p: every forward ran in the warm-up; the first backward's gradient comes now.
            self.output_grads[v - 1].append(self.p2p.recv_backward(shape))
        for k in range(self.remaining, self.total):
            input_grad = self.backward_k(k)
            next_backward = self.chunk_id(k + 1, forward=False)
            recv_next = not (self.rank == self.size - 1 and next_backward == v - 1) \
                and k != self.total - 1
            grad = self.p2p.send_backward_recv_backward(input_grad, recv_next, shape)
            if recv_next:
                self.output_grads[next_backward].append(grad)
