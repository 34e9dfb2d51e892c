"""Where the trainer's nodes meet: the rendezvous store, bound to one address, and going back to it.

torchrun's c10d rendezvous keeps its state in a TCPStore at `parallel.rendezvous_endpoint`, and
every node unpickles that state: whoever can write to the store runs code on every node. torch
would host it on every interface of the endpoint's machine (a TCPStore server listens on all of
them, whatever host it is given) and without authentication. So the launcher hosts it itself, on
a socket bound to the endpoint's address only (`listener`), and torchrun joins it as a client
(`is_host=false`); rank 0 binds the ranks' store to its node's address the same way (parallel.py).
What else keeps them private is the network: docs/operations.md, "The trainer's rendezvous and the
ranks' stores".

A node hosts the store when it can bind the endpoint's address (it is one of this machine's);
the others wait until the store answers (`Rendezvous.reach`). When the nodes lose each other
around the rendezvous (a node that joined a round stopped before the ranks started, or the
store's host stopped), torchrun raises a store error on the node that is left; the launcher does
not end the trainer for it (`lost` says which errors these are): the node hosts a fresh store if
it hosted the old one (torchrun leaves the old one closed or half-way through a round) and goes
back to the rendezvous to wait for the others, so a node that restarts finds a store to join.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from tandem_trainer.errors import RendezvousFailed

if TYPE_CHECKING:
    from tandem.settings import ParallelSettings

log = logging.getLogger("tandem_trainer")

#: How often a node that waits for the store's host tries again, in seconds.
RETRY_INTERVAL_S = 1.0


def listener(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`'s address only (port 0: a free one), for a TCPStore server
    (`master_listen_fd`). OSError when the address is not this machine's (EADDRNOTAVAIL) or the
    port is taken (EADDRINUSE); socket.gaierror when `host` does not resolve."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a store hosted again at once
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def store_server(sock: socket.socket, *, world: int | None = None, timeout_s: float = 300) -> Any:
    """A TCPStore server on `sock` (from `listener`), which it takes over; `world`: how many
    clients it waits for before it returns (none when unset)."""
    import torch.distributed as dist

    host, port = sock.getsockname()[:2]
    return dist.TCPStore(  # type: ignore[attr-defined]  # torch's stubs hide it
        host, port, world, is_master=True, wait_for_workers=world is not None,
        timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach(),
    )


def lost(exc: BaseException) -> bool:
    """Whether torchrun's error means that the nodes lost each other around the rendezvous (a node
    stopped after joining a round, the store's host stopped, a node closed the round on its way
    out), after which a node goes back to the rendezvous; not that nobody came in time
    (RendezvousTimeoutError) nor anything else."""
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousStateError,
    )

    return isinstance(exc, DistError | RendezvousClosedError | RendezvousConnectionError | RendezvousStateError)


def what_happened(exc: BaseException) -> str:
    """A lost rendezvous in tandem's words (`lost`), with torch's first line."""
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    cause = exc.__cause__ or exc  # torch's rendezvous errors say "see inner exception"
    detail = (str(cause).strip().splitlines() or [""])[0][:200]
    if isinstance(exc, DistStoreError) and "timeout" in detail:
        said = "a node that joined the round stopped before the ranks started (the rendezvous store waited for it)"
    elif isinstance(exc, RendezvousClosedError):
        said = "another node closed the round on its way out (it stopped or lost the store)"
    elif isinstance(exc, DistNetworkError):
        said = "the rendezvous store went away (its host stopped)"
    else:
        said = "the rendezvous store cannot be reached (its host stopped)"
    return f"{said}; {type(cause).__name__}: {detail}" if detail else f"{said}; {type(cause).__name__}"


class Rendezvous:
    """This node's way to the rendezvous at `host:port`: the store it hosts there when the
    address is this machine's, else the host it waits for."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._store: Any = None

    @classmethod
    def of(cls, parallel: ParallelSettings) -> Rendezvous:
        """The rendezvous at `parallel.rendezvous_endpoint`; without one (one machine), a store
        hosted at once on a free port of loopback."""
        if parallel.rendezvous_endpoint is None:
            sock = listener("127.0.0.1", 0)
            alone = cls("127.0.0.1", sock.getsockname()[1])
            alone._store = store_server(sock)
            return alone
        host, _, port = parallel.rendezvous_endpoint.rpartition(":")
        return cls(host, int(port))

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def hosting(self) -> bool:
        return self._store is not None

    def reach(self, timeout_s: float) -> None:
        """Until this node hosts the store or its host answers; RendezvousFailed after `timeout_s`."""
        started = time.monotonic()
        deadline = started + timeout_s
        waiting = False
        while not self.hosting:
            try:
                sock = listener(self.host, self.port)
            except socket.gaierror as exc:
                problem = f"{self.host!r} does not resolve ({exc.strerror})"
            except OSError as exc:
                if exc.errno not in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
                    raise RendezvousFailed(f"cannot host the rendezvous at {self.endpoint}: {exc}") from exc
                if self._answers():  # another machine's address, or another process here hosts it
                    if waiting:
                        log.info("trainer.rendezvous_found endpoint=%s waited_s=%.1f: its host answers; joining",
                                 self.endpoint, time.monotonic() - started)
                    return
                problem = "nothing answers there"
            else:
                address = sock.getsockname()[0]
                self._store = store_server(sock)
                log.info("trainer.rendezvous_host endpoint=%s: this node hosts the rendezvous store, "
                         "listening on %s only", self.endpoint, address)
                return
            if time.monotonic() >= deadline:
                raise RendezvousFailed(
                    f"the rendezvous at {self.endpoint} did not answer within parallel.rendezvous_timeout_s="
                    f"{timeout_s:.0f}s ({problem}); start the node whose address it names"
                )
            if not waiting:
                waiting = True
                log.info("trainer.rendezvous_wait endpoint=%s: %s; waiting up to %.0fs for the node that "
                         "hosts it", self.endpoint, problem, timeout_s)
            time.sleep(RETRY_INTERVAL_S)

    def renew(self) -> None:
        """Stop hosting the store (its clients lose it): the next `reach` hosts a fresh one,
        since torchrun leaves the old one closed or half-way through a round."""
        self._store = None

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=2):
                return True
        except OSError:
            return False
