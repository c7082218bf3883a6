"""``python -m matrixopt``: the same as the ``matrixopt`` console script."""

import sys

from matrixopt.cli import main

sys.exit(main())
