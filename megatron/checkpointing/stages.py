"""Which layers each pipeline stage of a Megatron-LM checkpoint holds, and under which numbers.

A checkpoint with ``pipeline_size`` stages has one shard directory per (TP rank, PP rank)
(``mp_rank_XX_YYY``). Each stage holds an even share of the layers, numbered from 0 in its
files (``layers.N`` is local to the stage); the first stage also holds the embedding, the last
the final LayerNorm and the output weight. With virtual pipeline stages (the interleaved
schedule) each shard holds several model chunks, ``model0``, ``model1``..., and chunk ``v`` of
stage ``p`` starts at layer ``v * (L / vp) + p * (L / (pp * vp))`` (Megatron-LM's
``ParallelTransformer`` offset); the embedding is on chunk 0 of stage 0, the head on the last
chunk of the last stage.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageChunk:
    """One model chunk of one pipeline stage: ``sd[model_key]`` of the stage's files."""

    pipeline_rank: int
    virtual_rank: int | None
    """None without virtual pipeline stages (the files hold ``model``)."""
    first_layer: int
    """Global number of the chunk's layer 0."""
    num_layers: int
    pre_process: bool
    """Holds the embedding (first chunk of the first stage)."""
    post_process: bool
    """Holds the final LayerNorm and the output weight (last chunk of the last stage)."""

    @property
    def model_key(self) -> str:
        return "model" if self.virtual_rank is None else f"model{self.virtual_rank}"

    def holds_layer(self, layer: int) -> bool:
        return self.first_layer <= layer < self.first_layer + self.num_layers


@dataclass(frozen=True)
class PipelineStages:
    """The pipeline split of a model of ``num_layers`` layers (Megatron-LM's even split).

    Raises:
        ValueError: sizes below 1, or layers that do not split evenly.
    """

    num_layers: int
    pipeline_size: int = 1
    virtual_size: int | None = None
    """Model chunks per stage (``--num-layers-per-virtual-pipeline-stage`` gives
    ``num_layers / pipeline_size / that``); None without the interleaved schedule."""

    def __post_init__(self) -> None:
        chunks = self.pipeline_size * (self.virtual_size or 1)
        if self.num_layers < 1 or self.pipeline_size < 1 or (self.virtual_size or 1) < 1:
            raise ValueError(f"num_layers ({self.num_layers}), pipeline_size "
                             f"({self.pipeline_size}) and virtual_size ({self.virtual_size}) "
                             "must be positive")
        if self.num_layers % chunks:
            raise ValueError(f"num_layers ({self.num_layers}) is not divisible by "
                             f"pipeline_size ({self.pipeline_size}) x virtual_size "
                             f"({self.virtual_size or 1}): every model chunk holds the same "
                             "number of layers")

    def chunks(self) -> list[StageChunk]:
        """Every model chunk, by pipeline rank, then virtual rank (the order of the files and
        of ``model0``, ``model1``... inside them)."""
        pp = self.pipeline_size
        # One chunk per stage is saved as ``model``, as Megatron-LM saves a one-chunk list.
        vp = self.virtual_size if (self.virtual_size or 1) > 1 else None
        per_chunk = self.num_layers // (pp * (vp or 1))
        out = []
        for p in range(pp):
            for v in (range(vp) if vp else [None]):
                offset = (v or 0) * (self.num_layers // (vp or 1)) + p * per_chunk
                out.append(StageChunk(
                    pipeline_rank=p, virtual_rank=v, first_layer=offset, num_layers=per_chunk,
                    pre_process=p == 0 and (v or 0) == 0,
                    post_process=p == pp - 1 and (v is None or v == vp - 1)))
        return out

    def chunk_index_of_layer(self, layer: int) -> int:
        """Index in :meth:`chunks` of the chunk holding global layer ``layer``.

        Raises:
            ValueError: no such layer.
        """
        for i, chunk in enumerate(self.chunks()):
            if chunk.holds_layer(layer):
                return i
        raise ValueError(f"layer {layer} does not exist in a model of {self.num_layers} layers")
