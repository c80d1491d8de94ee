"""Whether a directory holds a ``torch_dist`` checkpoint, without importing
``torch.distributed.checkpoint`` (a second or more at start-up, which runs in the legacy
format need not pay)."""

from __future__ import annotations

import json
from pathlib import Path

BACKEND_FILE = "metadata.json"


def is_torch_dist_dir(path: Path) -> bool:
    """Whether ``path`` holds a ``torch_dist`` checkpoint (its ``metadata.json`` says so)."""
    try:
        return json.loads((path / BACKEND_FILE).read_text()).get("sharded_backend") == \
            "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False
