"""Where each worker runs: its host (hostname, address), rank, local and cross rank and size.

Read from keras_boost and from Horovod itself, so a test can check the placement a launch
asked for (`-H kbh1:2,kbh2:2`, a hostfile) against what the workers see.
"""

import socket

from common import report

from keras_boost import distributed


def run():
    distributed.init()
    hvd = distributed.horovod() if distributed.launched() else None
    hostname = socket.gethostname()
    names = distributed.allgather_object(hostname, name="kb_topology_hosts")
    return dict(hostname=hostname, address=socket.gethostbyname(hostname), rank=distributed.rank(),
                size=distributed.size(), local_rank=distributed.local_rank(), local_size=distributed.local_size(),
                cross_rank=hvd.cross_rank() if hvd else 0, cross_size=hvd.cross_size() if hvd else 1,
                homogeneous=bool(hvd.is_homogeneous()) if hvd else True,
                controller=distributed.capabilities()["controller"], hosts_by_rank=names)


if __name__ == "__main__":
    report(distributed.rank(), **run())
