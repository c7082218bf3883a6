"""``python -m matrixopt``: the same as the ``matrixopt`` console script. A torchrun worker (``torchrun ... -m
matrixopt train``) leaves through :func:`matrixopt.distributed.comm.leave`, without interpreter teardown."""

import os
import sys

from matrixopt.cli import main

code = main()
if "LOCAL_RANK" in os.environ:  # started by torchrun
    from matrixopt.distributed.comm import leave

    leave(code)
sys.exit(code)
