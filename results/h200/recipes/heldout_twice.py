"""Write the 96 held-out prompts twice over (ids suffixed -0 and -1) to the path given: the 192-prompt
file of the batch-64 job (job_vs_torch.sh, job_b64.sh).
    python3 results/h200/recipes/heldout_twice.py /tmp/heldout-192.jsonl"""

import json
import sys
from pathlib import Path

HELDOUT = Path(__file__).resolve().parents[2] / "heldout-prompts-96.jsonl"

lines = [json.loads(x) for x in HELDOUT.read_text().splitlines() if x.strip()]
with open(sys.argv[1], "w") as f:
    for rep in range(2):
        for x in lines:
            f.write(json.dumps(dict(x, id=f"{x['id']}-{rep}")) + "\n")
