"""Same as the `ddtree-bench` console script."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddtree_jax.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
