"""Forward/backward schedules (no pipelining, 1F1B, interleaved 1F1B) and the point-to-point
communication between pipeline stages."""

from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
