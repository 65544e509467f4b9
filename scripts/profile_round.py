"""Per-kernel profile of the ar step and the ddtree round on the bench's random-weight model
(`ddtree_jax.kernel_profile`), e.g.
  python3 scripts/profile_round.py --shape qwen3-8b --batch 1 --context 1024 --budget 63 --out b1.json"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddtree_jax.kernel_profile import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
