"""A real two-node run on one machine: two network namespaces joined by a veth pair.

Each "node" is a network namespace (``ip netns``) with one end of a veth pair (10.77.X.1 and
.2): its processes see only their own interface and loopback, so every byte between the nodes
crosses the veth link, as between hosts. The test creates the namespaces and always deletes
them; it skips, naming the reason, where the kernel or the permissions do not allow it.

On each node ``torchrun --nnodes 2 --node-rank N --nproc-per-node 2 --rdzv-backend c10d
--rdzv-endpoint 10.77.X.1:PORT --local-addr <its address>`` (gloo over ``GLOO_SOCKET_IFNAME``
= the node's veth) starts TP=2 x DP=2: each node holds one tensor-parallel pair, the
data-parallel all-reduce crosses the link. Promised:

* it trains and saves (both TP shards, checksums verified), and its losses equal the one-node
  run's (the same four ranks under one torchrun on 127.0.0.1);
* killing one node's processes (SIGKILL to its torchrun and ranks: the node dies) ends the other
  node promptly, nonzero, with a message naming the failure and the dead node's address -- not
  the 30-minute collective timeout. CI kills node 1; ``FAULT_SOAK=1`` also kills node 0, whose
  torchrun hosts the rendezvous store.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid

import pytest

from megatron.checkpointing.files import verify_checksum
from tests.faults import harness as h

# A dead node must end the survivor well within this (hang bound, not a timing assertion).
PROMPT_S = 120
LAYOUT = ["--tensor-model-parallel-size", 2]
KILL_AFTER = 7  # iterations logged: the save at 6 is done (the tracker moves before the
# barrier that lets the last rank log iteration 7)


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


class TwoNodes:
    """Two namespaces ``<tag>0`` / ``<tag>1`` on a veth pair; :meth:`delete` removes them."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.names = [f"mf{tag}n{i}" for i in range(2)]
        self.links = [f"mf{tag}v{i}" for i in range(2)]
        subnet = 64 + int(tag, 16) % 128
        self.addrs = [f"10.77.{subnet}.{i + 1}" for i in range(2)]

    def create(self) -> str | None:
        """Set up; returns why it cannot be done here (None when it worked)."""
        if shutil.which("ip") is None:
            return "the ip command (iproute2) is not installed"
        steps = [("netns", "add", self.names[0]), ("netns", "add", self.names[1]),
                 ("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])]
        for i in range(2):
            steps += [("link", "set", self.links[i], "netns", self.names[i]),
                      ("-n", self.names[i], "addr", "add", f"{self.addrs[i]}/24", "dev",
                       self.links[i]),
                      ("-n", self.names[i], "link", "set", self.links[i], "up"),
                      ("-n", self.names[i], "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                return f"`ip {' '.join(step)}` failed: {done.stderr.strip()}"
        return None

    def delete(self) -> None:
        for name in self.names:  # deleting a namespace deletes its end of the veth pair too
            _ip("netns", "delete", name)

    def launch(self, node: int, flags: list, log, port: int) -> h.Job:
        torchrun_args = ["--nnodes", "2", "--node-rank", str(node), "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", f"{self.addrs[0]}:{port}",
                         "--rdzv-id", self.names[0], "--local-addr", self.addrs[node],
                         # torchrun finds the store's host by its hostname, which the
                         # namespaces share: say which node hosts it.
                         "--rdzv-conf", f"is_host={int(node == 0)}"]
        return h.launch("pretrain_gpt.py", flags, log, nproc=2, name=f"{self.names[node]}",
                        torchrun_args=torchrun_args, prefix=["ip", "netns", "exec",
                                                             self.names[node]],
                        env={"GLOO_SOCKET_IFNAME": self.links[node]})


@pytest.fixture
def two_nodes():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    nodes = TwoNodes()
    try:
        reason = nodes.create()
        if reason is not None:
            pytest.skip(f"cannot build two network namespaces here: {reason}")
        yield nodes
    finally:
        nodes.delete()


SOAK = os.environ.get("FAULT_SOAK") == "1"


@pytest.mark.parametrize("dead", [
    1, pytest.param(0, marks=pytest.mark.skipif(
        not SOAK, reason="soak only (FAULT_SOAK=1): a second two-node launch, killing the node "
                         "that hosts the rendezvous store"))], ids=["node1", "node0"])
def test_two_nodes_train_save_equal_one_node_and_a_dead_node_ends_the_other(two_nodes,
                                                                            tmp_path, dead):
    save = tmp_path / "save"  # one file system, as a shared one would be on a cluster
    flags = h.tiny_gpt_flags(train_iters=h.PP2_ITERS, global_batch_size=4, extra=[
        *LAYOUT, "--save", save, "--save-interval", 3])
    one_node = h.launch("pretrain_gpt.py", h.tiny_gpt_flags(
        train_iters=h.PP2_ITERS, global_batch_size=4, extra=LAYOUT),
        tmp_path / "one_node.log", nproc=4)
    port = 29400 + int(two_nodes.names[0][2:8], 16) % 1000
    nodes = [two_nodes.launch(n, flags, tmp_path / f"node{n}.log", port) for n in range(2)]
    try:
        # The last rank (on node 1) logs the iterations.
        nodes[1].wait_for(f" iteration {KILL_AFTER:8d}/")
        nodes[dead].kill_all()
        killed_at = time.monotonic()
        code_dead = nodes[dead].wait()
        code_survivor = nodes[1 - dead].wait(timeout=PROMPT_S)
        survivor_s = time.monotonic() - killed_at
        assert one_node.wait() == 0, one_node.tail()
    finally:
        for job in [*nodes, one_node]:
            job.reap()
    assert code_dead != 0
    survivor = nodes[1 - dead]
    # Trains and equals the one-node run.
    two = nodes[1].losses()
    assert KILL_AFTER <= max(two) < h.PP2_ITERS
    h.compare_losses(one_node.losses(), two)
    # Saves: the checkpoint at 6 at least (a later one only complete: the tracker moves last).
    saved = h.tracker(save)
    assert saved is not None and saved >= 6 and saved % 3 == 0, survivor.tail()
    shards = sorted((save / f"iter_{saved:07d}").rglob("*.pt"))
    assert [p.parent.name for p in shards] == ["mp_rank_00", "mp_rank_01"], shards
    assert all(verify_checksum(p) for p in shards)
    # The surviving node ended promptly, nonzero, saying what failed.
    text = survivor.text()
    assert code_survivor != 0, survivor.tail()
    failures = re.findall(r"^\[rank (\d)\] ((?:failed|stopping).*)$", text, re.M)
    print(f"survivor ended {survivor_s:.1f} s after the kill: {failures}")
    if dead == 0 and not failures:
        # The store's host is gone: the survivor's torchrun may notice first (its heartbeat)
        # and stop its ranks before their next collective fails; torchrun names the cause.
        assert "failed to send a keep-alive heartbeat to the rendezvous" in text, survivor.tail()
        return
    assert failures, survivor.tail()
    assert {int(rank) // 2 for rank, _ in failures} == {1 - dead}, failures
    # The peer that went away is named by its node's address.
    assert any(two_nodes.addrs[dead] in message for _, message in failures), failures
