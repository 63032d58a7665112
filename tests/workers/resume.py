"""Both resume scenarios on 2 workers; reports whether each resumed run equals its reference."""

import hashlib
import sys
import tempfile

from common import report

from keras_boost import distributed
from tests import resume_scenarios
from tests.helpers import weights


def run(shared):
    """`shared`: a directory both workers see."""
    distributed.init()
    with tempfile.TemporaryDirectory() as local:
        ref_a, resumed_a = resume_scenarios.checkpoint_mid_window(local)
    ref_b, resumed_b = resume_scenarios.backup_and_restore(f"{shared}/backup")
    digest = hashlib.sha256(b"".join(w.tobytes() for w in weights(resumed_b))).hexdigest()
    return dict(checkpoint=resume_scenarios.identical(ref_a, resumed_a),
                backup=resume_scenarios.identical(ref_b, resumed_b), digest=digest)


def main():
    values = run(sys.argv[1])
    report(distributed.rank(), **values)


if __name__ == "__main__":
    main()
