"""Trainer nodes that lose each other around the rendezvous: two `tandem-trainer` processes as two
nodes of one rank each, meeting at a c10d rendezvous on loopback, gloo on the CPU.

A node that dies just as the round closes, or the node that hosts the rendezvous store, must not
take the other node down: the one left goes back to the rendezvous (hosting a fresh store when it
can) and waits there for the other, which meets it when it comes back.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import psutil
import pytest
from helpers.loopback import free_port
from helpers.workers import WorkerProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: A node that joins the rendezvous through torch's own handler and is killed the moment the round
#: closes, before it writes what the others wait for: a node lost between the round and its ranks.
DIES_AS_THE_ROUND_CLOSES = """
import os, signal, sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

handler = get_rendezvous_handler(RendezvousParameters(
    backend="c10d", endpoint=sys.argv[1], run_id="tandem-trainer", min_nodes=2, max_nodes=2,
    local_addr="127.0.0.1", join_timeout="60", is_host="false"))
handler.next_rendezvous()
os.kill(os.getpid(), signal.SIGKILL)
"""


def node_env(port: int) -> dict[str, str]:
    return {
        "TANDEM_PARALLEL__NODES": "2", "TANDEM_PARALLEL__RANKS": "1",
        "TANDEM_PARALLEL__RENDEZVOUS_ENDPOINT": f"127.0.0.1:{port}",
        "TANDEM_PARALLEL__NODE_ADDRESS": "127.0.0.1", "TANDEM_PARALLEL__RENDEZVOUS_TIMEOUT_S": "150",
        "TANDEM_WORKER_NAME": "trainer", "OMP_NUM_THREADS": "1",
    }


def answers(port: int) -> bool:
    """Whether something listens at the rendezvous endpoint (the store of the node hosting it)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def kill_node(node: WorkerProcess) -> None:
    """SIGKILL the node's launcher and its ranks at once, as a machine or container that dies."""
    launcher = psutil.Process(node.proc.pid)
    for proc in [*launcher.children(recursive=True), launcher]:
        proc.send_signal(signal.SIGKILL)
    node.proc.wait(10)


def test_a_node_killed_as_the_round_closes_leaves_the_other_waiting_for_it(workers, redis_conn) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    # what the dead node never writes is waited for parallel.rendezvous_read_timeout_s (60 s unset)
    env = {**node_env(port), "TANDEM_PARALLEL__RENDEZVOUS_READ_TIMEOUT_S": "15"}
    first = workers(env)
    wait_for(lambda: answers(port), 90, "the first node to host the rendezvous", first)

    dying = subprocess.run([sys.executable, "-c", DIES_AS_THE_ROUND_CLOSES, f"127.0.0.1:{port}"],
                           capture_output=True, text=True, timeout=90)
    assert dying.returncode == -signal.SIGKILL, dying.stderr[-3000:]

    # torch's store waits 15 s for what the dead node never wrote; the first node then goes back
    wait_for(lambda: "trainer.rendezvous_lost" in first.log(), 100, "the first node to go back to the rendezvous",
             first)
    log = first.log()
    assert "a node that joined the round stopped before the ranks started" in log
    assert "waits up to 150s for the other nodes" in log
    second = workers(env)
    wait_for(lambda: "parallel.start rank=" in first.log() and "parallel.start rank=" in second.log(), 120,
             "the two nodes to meet", first)
    assert "world=2" in first.log() and "world=2" in second.log()
    assert first.log().count("trainer.rendezvous_host") == 2  # a fresh store for the new round
    assert "Traceback" not in first.log()


def test_a_node_that_lost_the_rendezvous_host_hosts_it_and_the_restarted_node_joins(workers, redis_conn) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    host = workers(node_env(port))
    wait_for(lambda: answers(port), 90, "the first node to host the rendezvous", host)
    other = workers(node_env(port))
    wait_for(lambda: "parallel.start rank=" in host.log() and "parallel.start rank=" in other.log(), 120,
             "the two nodes to meet", other)
    assert "trainer.rendezvous_host" not in other.log()
    # the rendezvous store, the ranks' store (on rank 0's node) and gloo's listeners: no node
    # listens on every interface, and the stores on the node's address (127.0.0.1 here)
    addresses = host.listening_on() | other.listening_on()
    assert "127.0.0.1" in addresses and not addresses & {"0.0.0.0", "::"}, addresses

    kill_node(host)  # the rendezvous store goes with it
    # the port may answer a moment before the node has logged that it hosts: wait for both
    wait_for(lambda: answers(port) and "trainer.rendezvous_host" in other.log(), 90,
             "the node left to host the rendezvous", other)
    assert "trainer.rendezvous_lost" in other.log() and "trainer.rendezvous_host" in other.log()
    back = workers(node_env(port))
    wait_for(lambda: "parallel.start rank=" in back.log() and other.log().count("parallel.start rank=") == 2, 120,
             "the restarted node to meet the one left", other)
    assert "world=2" in back.log()
    assert "Traceback" not in other.log()


def test_a_node_that_nobody_meets_exits_saying_so(workers, redis_conn) -> None:  # type: ignore[no-untyped-def]
    alone = workers({**node_env(free_port()), "TANDEM_PARALLEL__RENDEZVOUS_TIMEOUT_S": "10"})
    assert alone.wait_dead(90) == 1
    log = alone.log()
    assert "trainer.rendezvous_failed the other nodes did not come to the rendezvous at 127.0.0.1:" in log
    assert "within parallel.rendezvous_timeout_s=10s; exiting" in log
    assert "Traceback" not in log
