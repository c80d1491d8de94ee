"""Building this rank's pipeline stage of a model: which layers it holds, and the model chunk
itself from ``parallel_state``'s groups (Megatron's ``get_model`` calling a model provider).

Every model is built the same way, ``build_model_stage(GPTModel, config, parallel_output=...)``
or ``build_model_stage(Classification, config, num_classes=3)``: the class's own keyword
arguments pass through.
"""

from __future__ import annotations

from typing import TypeVar

from megatron.core import parallel_state
from megatron.core.models.language_module import LanguageModule, initialize_word_embeddings
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.moe.moe_layer import ExpertGroups

ModelT = TypeVar("ModelT", bound=LanguageModule)


def pipeline_stage_layers(num_layers: int, pipeline_size: int, pipeline_rank: int,
                          virtual_size: int | None = None, virtual_rank: int | None = None
                          ) -> tuple[int, int]:
    """``(layers on the model chunk, global index of its first layer)``: an even split.

    Without virtual stages chunk ``pipeline_rank`` holds ``L / pp`` layers from
    ``pipeline_rank * L / pp``. With ``virtual_size`` chunks per stage (the interleaved schedule)
    the model is cut into ``pp * vp`` chunks of ``L / (pp * vp)`` layers dealt round-robin: chunk
    ``virtual_rank`` of stage ``pipeline_rank`` starts at Megatron's
    ``virtual_rank * (L / vp) + pipeline_rank * L / (pp * vp)``.

    Raises:
        ValueError: the layers do not split evenly over the chunks.
    """
    chunks = pipeline_size * (virtual_size or 1)
    if num_layers % chunks != 0:
        what = f"the pipeline size ({pipeline_size})" if virtual_size is None else \
            f"the pipeline size ({pipeline_size}) x virtual stages ({virtual_size})"
        raise ValueError(f"num_layers ({num_layers}) is not divisible by {what}: give every "
                         "model chunk the same number of layers")
    per_chunk = num_layers // chunks
    if virtual_size is None:
        return per_chunk, pipeline_rank * per_chunk
    return per_chunk, (virtual_rank or 0) * (num_layers // virtual_size) + \
        pipeline_rank * per_chunk


def build_model_stage(model_cls: type[ModelT], config: TransformerConfig, *,
                      pre_process: bool | None = None, post_process: bool | None = None,
                      **kwargs) -> ModelT:
    """This rank's pipeline stage of ``model_cls`` with parallel_state's groups (one process
    when they are not initialized), its tied output weight equal on the first and last stage.

    Seed first, identically on all TP ranks (Megatron: ``torch.manual_seed(seed + 100 * pp_rank)``
    and :func:`~megatron.core.tensor_parallel.model_parallel_manual_seed`): the weights are drawn
    from torch's default generator.

    Args:
        model_cls: a :class:`~megatron.core.models.language_module.LanguageModule` subclass.
        config: the model's settings (all layers: this stage gets its even share; with virtual
            stages, the chunk of ``parallel_state``'s current virtual rank).
        pre_process: holds the embedding (default: the first pipeline stage).
        post_process: holds the head (default: the last pipeline stage).
        kwargs: passed on to ``model_cls`` (e.g. ``parallel_output``, ``add_binary_head``,
            ``num_classes``).
    """
    tp_group = None  # this rank alone: a single process without parallel_state's groups
    if parallel_state.model_parallel_is_initialized():
        tp_group = parallel_state.get_tensor_model_parallel_group()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    vpp_rank = parallel_state.get_virtual_pipeline_model_parallel_rank()
    num_layers, layer_offset = pipeline_stage_layers(config.num_layers, pp, pp_rank, vpp,
                                                     vpp_rank)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    if parallel_state.get_context_parallel_world_size() > 1:
        kwargs["cp_group"] = parallel_state.get_context_parallel_group()
    if config.num_moe_experts:
        kwargs["expert_groups"] = _expert_groups(tp_group)
    model = model_cls(config, tp_group, pre_process=pre_process, post_process=post_process,
                      num_layers=num_layers, layer_offset=layer_offset, **kwargs)
    # With virtual stages only the chunk holding the embedding (chunk 0 of stage 0) or the head
    # (last chunk of the last stage) is in the group; each member rank joins the sum once.
    if pp > 1 and parallel_state.is_rank_in_embedding_group() and (pre_process or post_process):
        initialize_word_embeddings(model, parallel_state.get_embedding_group())
    return model


def _expert_groups(tp_group) -> ExpertGroups | None:
    """The MoE layers' expert-grid groups (expert parallelism) and DP x CP group (the global
    balancing loss's token counts); None: a single process."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if parallel_state.has_expert_grid():
        return ExpertGroups(ep=parallel_state.get_expert_model_parallel_group(),
                            etp=parallel_state.get_expert_tensor_parallel_group(),
                            tp_ep=parallel_state.get_expert_tensor_and_model_parallel_group(),
                            dp_cp=dp_cp)
    return ExpertGroups(ep=None, etp=tp_group, tp_ep=tp_group, dp_cp=dp_cp)

