"""Forward/backward schedules (no pipelining now; 1F1B and interleaved slot in here)."""

from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
