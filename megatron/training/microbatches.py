"""How many micro-batches make one global batch, with Megatron's optional batch-size ramp-up."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class NumMicroBatchesCalculator:
    """global batch / (micro batch x DP), growing during ``--rampup-batch-size``.

    Ramp-up ``start increment samples``: the global batch starts at ``start`` and grows by
    ``increment`` evenly over ``samples`` consumed samples until it reaches ``global_batch_size``.
    """

    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    rampup_batch_size: list[str] | None = None
    current_global_batch_size: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.micro_times_dp = self.micro_batch_size * self.data_parallel_size
        self.current_global_batch_size = self.global_batch_size
        if self.rampup_batch_size is not None:
            start, incr, samples = (int(v) for v in self.rampup_batch_size)
            if start <= 0 or incr <= 0 or samples < 0:
                raise ValueError(f"--rampup-batch-size values must be positive, got "
                                 f"{self.rampup_batch_size}")
            for flag, value in (("start", start), ("increment", incr)):
                if value % self.micro_times_dp != 0:
                    raise ValueError(
                        f"--rampup-batch-size {flag} ({value}) must be a multiple of "
                        f"--micro-batch-size x data-parallel size ({self.micro_times_dp})")
            if (self.global_batch_size - start) % incr != 0:
                raise ValueError(f"--global-batch-size ({self.global_batch_size}) minus the "
                                 f"ramp-up start ({start}) must be a multiple of the increment "
                                 f"({incr})")
            steps = (self.global_batch_size - start) // incr
            self._start, self._incr = start, incr
            self._samples_per_increment = samples / steps if steps else 0.0
            self.update(0)

    def update(self, consumed_samples: int) -> None:
        """Recompute the current global batch size after ``consumed_samples`` samples."""
        if self.rampup_batch_size is None:
            return
        if self._samples_per_increment == 0:
            self.current_global_batch_size = self.global_batch_size
            return
        steps = int(consumed_samples / self._samples_per_increment)
        self.current_global_batch_size = min(self.global_batch_size,
                                             self._start + steps * self._incr)

    def get(self) -> int:
        """Micro-batches per step for the current global batch size."""
        return self.current_global_batch_size // self.micro_times_dp
