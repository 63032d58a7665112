"""A key-value store where every worker publishes where it is in `fit` (keras_boost.fit.watchdog).

Under Gloo it is horovodrun's own rendezvous store. Under MPI (`horovodrun --mpi`, `mpirun`,
`srun`) there is none, so rank 0 serves one (`serve_store`, called by `distributed.init`).
Requests time out after `ProgressStore.TIMEOUT` seconds: a worker whose host lost its link
must not block in them.
"""

import os
import socket

_SCOPE = "keras_boost_progress"

# This process's view of the store rank 0 serves (`serve_store`): {"address": "host:port"} once known.
# Kept in the module, not in the environment: a process that this one starts (a launch from a
# test, a script's own subprocess) must not inherit it.
_served = {}


class ProgressStore:
    """Where the workers publish their positions: the Gloo launcher's rendezvous key-value store,
    else the one rank 0 serves (`serve_store`: under MPI, `mpirun` and `srun`)."""

    def __init__(self):
        self.addr = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
        self.port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
        self.owner = "the launcher"
        if not (self.addr and self.port) and _served.get("address"):
            self.addr, _, self.port = _served["address"].rpartition(":")
            self.owner = "rank 0's progress store"

    @property
    def available(self):
        return bool(self.addr and self.port)

    # Horovod's own client (horovod.runner.http.http_client) waits without a bound; a worker
    # whose host lost its link would block in it instead of ending its process.
    TIMEOUT = 3.0

    def _url(self, key):
        return f"http://{self.addr}:{self.port}/{_SCOPE}/{key}"

    def put(self, key, value):
        from urllib.request import Request, urlopen

        from horovod.runner.common.util import codec

        request = Request(self._url(key), data=codec.dumps_base64(value, to_ascii=False), method="PUT")
        urlopen(request, timeout=self.TIMEOUT).close()

    def get(self, key):
        from urllib.request import urlopen

        from horovod.runner.common.util import codec

        with urlopen(self._url(key), timeout=self.TIMEOUT) as response:
            return codec.loads_base64(response.read())


def serve_store(rank, size, local_size, broadcast_object):
    """Gives the workers a key-value store for their positions where the launcher has none.

    Under Gloo, horovodrun's rendezvous store holds them. Under MPI (`horovodrun --mpi`,
    `mpirun`, `srun`) there is none, so rank 0 serves one (Horovod's own `KVStoreServer`, a
    daemon thread) and every rank learns its address from one broadcast; each rank keeps the
    first of rank 0's addresses it can connect to. Called by `distributed.init` on every rank;
    a store nobody can reach only leaves the messages without the other ranks' positions.
    """
    if size < 2 or os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") or "address" in _served:
        return
    offer = None
    if rank == 0:
        from horovod.runner.http.http_server import KVStoreServer

        server = KVStoreServer(verbose=0)
        port = server.start_server()
        _served["server"] = server
        offer = (_own_addresses(loopback_first=local_size == size), port)
    addresses, port = broadcast_object(offer)
    for address in addresses:
        try:
            socket.create_connection((address, port), timeout=1.0).close()
        except OSError:
            continue
        _served["address"] = f"{address}:{port}"
        return


def _own_addresses(loopback_first):
    """This host's IPv4 addresses, the loopback one first when every worker is on this host."""
    import psutil

    found = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET]
    loopback = [a for a in found if a.startswith("127.")]
    others = [a for a in found if not a.startswith("127.")]
    return (loopback + others) if loopback_first else (others + loopback)
