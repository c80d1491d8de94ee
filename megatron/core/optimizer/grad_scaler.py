"""Loss scalers for fp16 training: constant (``--loss-scale``) or dynamic.

Dynamic rules (Megatron-LM ``DynamicGradScaler``): on an inf/nan the growth tracker resets and the
hysteresis tracker drops by one; once it reaches 0 the scale halves (floored at
``--min-loss-scale``), and it halves again on every further overflow until a clean window. After
``--loss-scale-window`` consecutive clean steps the scale doubles and the hysteresis resets.
State dict: ``{"scale": tensor, "growth_tracker": int, "hysteresis_tracker": int}``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core import device


class ConstantGradScaler:
    """A fixed loss scale.

    Args:
        scale: the loss scale.
    """

    def __init__(self, scale: float) -> None:
        self._scale = torch.tensor([float(scale)], dtype=torch.float32,
                                   device=device.get_device())

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        """Nothing changes (overflowing steps are still skipped by the optimizer)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the scale comes from ``--loss-scale``."""


class DynamicGradScaler(ConstantGradScaler):
    """A loss scale that backs off on overflow and grows after a window of clean steps.

    Args:
        initial_scale: starting scale (``--initial-loss-scale``).
        min_scale: floor (``--min-loss-scale``).
        growth_factor: multiplier after a clean window (2).
        backoff_factor: multiplier on overflow once hysteresis is used up (0.5).
        growth_interval: clean steps before growing (``--loss-scale-window``).
        hysteresis: overflows tolerated before backing off (``--hysteresis``).

    Raises:
        ValueError: a non-positive scale or window, or factors on the wrong side of 1.
    """

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2) -> None:
        if initial_scale <= 0 or min_scale <= 0 or min_scale > initial_scale:
            raise ValueError(f"need 0 < --min-loss-scale ({min_scale}) <= "
                             f"--initial-loss-scale ({initial_scale})")
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(f"growth factor ({growth_factor}) must be > 1 and backoff factor "
                             f"({backoff_factor}) in (0, 1)")
        if growth_interval <= 0 or hysteresis <= 0:
            raise ValueError(f"--loss-scale-window ({growth_interval}) and --hysteresis "
                             f"({hysteresis}) must be positive")
        super().__init__(initial_scale)
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32,
                                      device=device.get_device())
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Apply the dynamic rules for one step."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale.clone(), "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scale = torch.as_tensor(state_dict["scale"], dtype=torch.float32,
                                      device=device.get_device()).reshape(1).clone()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
