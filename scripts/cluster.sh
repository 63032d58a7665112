#!/usr/bin/env bash
# A cluster of real hosts on this machine (network namespaces on a bridge, each with its own
# hostname, address and sshd), for trying and measuring multi-host training. Needs root.
#
#   ./scripts/cluster.sh up N [--rate RATE]   hosts kbh1..kbhN (10.213.0.1..N); RATE limits every link (100mbit)
#   ./scripts/cluster.sh run HOST -- CMD...   run CMD inside HOST (launch jobs from kbh1, as on a cluster)
#   ./scripts/cluster.sh down                 remove them
#
# Example: ./scripts/cluster.sh up 2 && ./scripts/cluster.sh run kbh1 -- .venv/bin/keras-boost train --hosts kbh1:1,kbh2:1
# See tests/cluster.py for what a host is.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
PY="$VENV/bin/python"; [ -x "$PY" ] || PY=python3
# the caller's folder stays the command's (`run kbh1 -- .venv/bin/keras-boost ...` from the repository)
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m tests.cluster "$@"
