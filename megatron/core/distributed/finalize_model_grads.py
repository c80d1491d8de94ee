"""``finalize_model_grads``: everything between the last backward and the optimizer step.

1. With pipeline parallelism and tied input/output embeddings, the first and last stages each
   hold a copy of the word embedding; their gradients are summed over the embedding group
   (``parallel_state.get_embedding_group()``) so both copies take the same step.
2. With sequence parallelism, the replicated parameters that act on each TP rank's ``s/TP``
   rows only (LayerNorms, row-parallel biases: the ``sequence_parallel`` attribute) hold partial
   gradients; they are summed over the TP group so every TP rank takes the same step.
3. The data-parallel reduction of every model chunk is completed (``finish_grad_sync``).

The embedding sum runs *before* the DP reduction whenever that reduction has not started yet:
with the distributed optimizer a rank only holds the reduced values of its own shard, and the two
stages shard differently, so summing afterwards would mix reduced and unreduced values. (Both
sums commute, so for the all-reduce path the order does not matter.) The TP sum of step 2 runs
before it as well; after an overlapped reduction it runs afterwards, which is also right for the
distributed optimizer: TP peers hold the same parameters in the same buffer layout, so their
shards cover the same elements.
"""

from __future__ import annotations

import torch

from megatron.core import comm, parallel_state


def finalize_model_grads(model_chunks: list[torch.nn.Module]) -> None:
    """Complete the gradient reductions of ``model_chunks`` (DP, and tied embeddings with PP).

    Args:
        model_chunks: the DDP-wrapped model chunks of this rank (one without virtual pipeline).

    Raises:
        NotImplementedError: tied embeddings with PP > 1 whose DP reduction already started
            (``--overlap-grad-reduce``) under the distributed optimizer: the shard-wise result
            could not be summed correctly.
    """
    started = any(chunk.grad_sync_started() for chunk in model_chunks)
    if not started:
        _allreduce_sequence_parallel_grads(model_chunks)
        _allreduce_embedding_grads(model_chunks)
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    if started:
        _allreduce_sequence_parallel_grads(model_chunks)
        if _tied_embedding_weight(model_chunks) is not None and any(
                getattr(c, "use_distributed_optimizer", False) for c in model_chunks):
            raise NotImplementedError(
                "tied embeddings with --pipeline-model-parallel-size > 1, "
                "--overlap-grad-reduce and --use-distributed-optimizer are not supported together "
                "yet; drop --overlap-grad-reduce or use --untie-embeddings-and-output-weights")
        _allreduce_embedding_grads(model_chunks)
    _update_router_state(model_chunks)


def _update_router_state(model_chunks: list[torch.nn.Module]) -> None:
    """The MoE routers' per-step state (Megatron does it here too): aux-loss-free balancing
    moves each expert's selection bias by its token count summed over TP x DP x CP (with
    sequence parallelism each TP rank routed its own rows, with context parallelism each CP
    rank its own chunks), and the global balancing loss starts a new global batch."""
    routers = [m for chunk in model_chunks for m in chunk.modules()
               if getattr(m, "local_tokens_per_expert", None) is not None
               or getattr(m, "global_tokens_per_expert", None) is not None]
    biased = [r for r in routers if getattr(r, "local_tokens_per_expert", None) is not None]
    if biased:
        counts = torch.stack([r.local_tokens_per_expert for r in biased])  # [routers, E]
        if parallel_state.model_parallel_is_initialized():
            comm.all_reduce(counts, parallel_state.get_tensor_model_parallel_group())
            comm.all_reduce(counts,
                            parallel_state.get_data_parallel_group(with_context_parallel=True))
        with torch.no_grad():
            for router, count in zip(biased, counts):
                router.update_expert_bias(count)
    for router in routers:
        router.reset_global_aux_loss_tracker()


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


def _allreduce_sequence_parallel_grads(model_chunks: list[torch.nn.Module]) -> None:
    if parallel_state.model_parallel_is_initialized():
        allreduce_sequence_parallel_grads(model_chunks,
                                          parallel_state.get_tensor_model_parallel_group())


def allreduce_sequence_parallel_grads(model_chunks: list[torch.nn.Module],
                                      tp_group: comm.ProcessGroup | None) -> None:
    """Sum the gradients (``main_grad``, else ``grad``) of the parameters marked
    ``sequence_parallel`` over ``tp_group``: one flat all-reduce per gradient dtype
    (Megatron's ``_allreduce_layernorm_grads``). Without sequence parallelism none is marked."""
    if comm.world_size(tp_group) == 1:
        return
    grads = [grad for chunk in model_chunks for param in chunk.parameters()
             if getattr(param, "sequence_parallel", False) and param.requires_grad
             and (grad := _grad_of(param)) is not None]
    for dtype in sorted({grad.dtype for grad in grads}, key=str):  # one all-reduce per dtype
        same = [grad for grad in grads if grad.dtype == dtype]
        flat = torch.cat([grad.reshape(-1) for grad in same])
        comm.all_reduce(flat, tp_group, "sum")
        for grad, summed in zip(same, torch.split(flat, [g.numel() for g in same])):
            grad.copy_(summed.view_as(grad))


def _needs_embedding_allreduce(model_chunks: list[torch.nn.Module]) -> bool:
    if not parallel_state.model_parallel_is_initialized():
        return False
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return False
    return parallel_state.is_rank_in_embedding_group(ignore_virtual=True)


def _shared_embedding_weight(model_chunks: list[torch.nn.Module]) -> torch.nn.Parameter | None:
    """The tied word-embedding weight on this stage (first chunk on the first stage, else last)."""
    if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
        chunk = model_chunks[0]
    elif parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        chunk = model_chunks[-1]
    else:
        return None
    module = getattr(chunk, "module", chunk)
    for name in ("shared_embedding_or_output_weight", "word_embeddings_weight"):
        getter = getattr(module, name, None)
        if getter is not None:
            return getter()
    return None


def _tied_embedding_weight(model_chunks: list[torch.nn.Module]) -> torch.nn.Parameter | None:
    """This stage's copy of the word embedding tied over the pipeline, whose gradient is summed
    with the other end's; None with PP = 1, on a middle stage, or untied
    (--untie-embeddings-and-output-weights: two independent weights, nothing to sum)."""
    if not _needs_embedding_allreduce(model_chunks):
        return None
    chunk = model_chunks[0] if parallel_state.is_pipeline_first_stage(True) else model_chunks[-1]
    if not getattr(getattr(chunk, "module", chunk), "share_embeddings_and_output_weights", True):
        return None
    return _shared_embedding_weight(model_chunks)


def _allreduce_embedding_grads(model_chunks: list[torch.nn.Module]) -> None:
    weight = _tied_embedding_weight(model_chunks)
    if weight is None:
        return
    grad = _grad_of(weight)
    if grad is not None:
        comm.all_reduce(grad, parallel_state.get_embedding_group(), "sum")
