"""The rendezvous store bound to one address, who hosts it, and which of torchrun's errors send a
node back to the rendezvous (tandem_trainer.rendezvous). Real sockets on loopback."""

from __future__ import annotations

import signal

import pytest
import torch.distributed as dist
from helpers.loopback import free_port
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)

from tandem.settings import ParallelSettings
from tandem_trainer.errors import RendezvousFailed
from tandem_trainer.rendezvous import Rendezvous, listener, lost, store_server, what_happened


def test_a_store_listens_on_the_address_it_is_given_only() -> None:
    sock = listener("127.0.0.1", 0)
    host, port = sock.getsockname()[:2]
    assert host == "127.0.0.1"
    server = store_server(sock)
    client = dist.TCPStore(host, port, is_master=False)  # type: ignore[attr-defined]
    client.set("key", "value")
    assert server.get("key") == b"value"


def test_the_ranks_of_one_machine_meet_at_a_store_on_loopback() -> None:
    import psutil

    alone = Rendezvous.of(ParallelSettings(ranks=2))
    assert alone.hosting and alone.host == "127.0.0.1" and alone.port != 0
    listening = {c.laddr for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    assert ("127.0.0.1", alone.port) in listening
    alone.reach(0)  # hosting already: nothing to wait for


def test_the_node_whose_address_the_endpoint_names_hosts_it_and_another_joins_it() -> None:
    port = free_port()
    first, second = Rendezvous("127.0.0.1", port), Rendezvous("127.0.0.1", port)
    first.reach(5)
    second.reach(5)  # the address is this machine's, but the port is taken by a store that answers
    assert (first.hosting, second.hosting) == (True, False)
    first.renew()  # the host lets the store go ...
    second.reach(5)  # ... and the node left hosts a fresh one
    assert second.hosting


def test_a_rendezvous_that_nobody_hosts_fails_naming_the_endpoint_and_the_setting() -> None:
    # TEST-NET-1 (RFC 5737): no machine's address; nothing answers there
    with pytest.raises(RendezvousFailed, match=r"the rendezvous at 192\.0\.2\.1:29400 did not answer within "
                                               r"parallel\.rendezvous_timeout_s=0s"):
        Rendezvous("192.0.2.1", 29400).reach(0)


def test_lost_nodes_send_a_node_back_to_the_rendezvous_but_nothing_else_does() -> None:
    inner = dist.DistNetworkError("Broken pipe")
    connection = RendezvousConnectionError("The connection to the C10d store has failed. See inner exception for details.")
    connection.__cause__ = inner
    for exc in (dist.DistStoreError("wait timeout after 60000ms, keys: /torch.rendezvous.x.0/role_info/1"),
                inner, connection, RendezvousClosedError()):
        assert lost(exc), exc
    for exc in (RendezvousTimeoutError(), SignalException("got SIGTERM", signal.SIGTERM), ValueError("x")):
        assert not lost(exc), exc
    assert what_happened(connection) == ("the rendezvous store cannot be reached (its host stopped); "
                                         "DistNetworkError: Broken pipe")
    assert what_happened(dist.DistStoreError("wait timeout after 60000ms")).startswith(
        "a node that joined the round stopped before the ranks started")
