"""`python -m ddtree_jax.bench SUB-COMMAND ...`: the same as the `ddtree-bench` console script."""

import sys

from ddtree_jax.bench.cli import main

sys.exit(main())
