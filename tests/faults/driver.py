"""A training script run with the fault suite's test hooks (run by torchrun as the script).

    torchrun ... tests/faults/driver.py SCRIPT <SCRIPT's flags>

runs SCRIPT (``pretrain_gpt.py``, ``pretrain_bert.py``...) as ``__main__``, exactly as torchrun
would, after installing the hooks its environment asks for:

* ``FAULT_PAUSE_IN_SAVE=ITERATION:WHERE`` -- the save of ITERATION stops in the middle, where
  a kill then hits a save deterministically: ``shard`` after a shard's bytes are written under
  its temporary name and before the rename; ``tracker`` after every shard is in place and the
  new tracker is written under its temporary name, before the rename that publishes it. The
  rank writes ``FAULT-HOOK paused in save: <file>`` and sleeps (the test kills it);
  ``before``: before the first byte of the iteration's first file, so that the test can change
  the world (fill the disk) before the save begins.
* ``FAULT_PAUSE_UNTIL=PATH`` -- a pause ends when PATH exists (instead of never).

The library has no test hooks of its own: the driver wraps the one function every checkpoint
file goes through (``megatron.checkpointing.files._atomic_write``).
"""

from __future__ import annotations

import os
import re
import runpy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.checkpointing import files  # noqa: E402

PAUSE_S = 3600.0


def _install_pause_in_save(spec: str) -> None:
    iteration, where = spec.split(":")
    wanted_dir = f"iter_{int(iteration):07d}"
    real_atomic_write = files._atomic_write

    def hit(path: Path, tmp: Path) -> bool:
        if where == "before":
            return wanted_dir in path.parts and not done
        if where == "tracker":
            return path.name == files.TRACKER_FILENAME and \
                tmp.read_text().strip() == str(int(iteration))
        return where == "shard" and wanted_dir in path.parts and \
            not path.name.endswith(files.CHECKSUM_SUFFIX)

    done = False

    def atomic_write(write, path: Path) -> None:
        nonlocal done
        if where == "before" and hit(Path(path), Path(path)):
            done = True
            _pause(path)

        def write_then_pause(tmp: Path) -> None:
            write(tmp)
            if where != "before" and hit(Path(path), Path(tmp)):
                _pause(path)
        real_atomic_write(write_then_pause, path)

    files._atomic_write = atomic_write


def _pause(path: Path) -> None:
    sys.stdout.write(f"FAULT-HOOK paused in save: {path} (rank {os.environ.get('RANK', '0')}, "
                     f"pid {os.getpid()})\n")
    sys.stdout.flush()
    until = os.environ.get("FAULT_PAUSE_UNTIL")
    deadline = time.monotonic() + PAUSE_S
    while time.monotonic() < deadline and not (until and os.path.exists(until)):
        time.sleep(0.05)


def main() -> None:
    script = sys.argv[1]
    spec = os.environ.get("FAULT_PAUSE_IN_SAVE")
    if spec:
        assert re.fullmatch(r"\d+:(before|shard|tracker)", spec), spec
        _install_pause_in_save(spec)
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
