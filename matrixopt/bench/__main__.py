"""``python -m matrixopt.bench SUBCOMMAND [--json PATH]``: the same benchmarks as ``matrixopt bench``."""

import argparse
import sys

from matrixopt.bench.cli import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m matrixopt.bench", description=__doc__)
add_arguments(parser)
sys.exit(run(parser.parse_args()))
