"""`ddtree-compare`: evidence that two decoders agree, and where and why they do not.

One module per sub-command (lossless, external, distribution, ...), each with `HELP`,
`add_arguments(parser)` and `run(args) -> Report`; `cli` registers them in `SUBCOMMANDS`. Shared
pieces: `inputs` (ddtree-generate's flags -> a loaded pair and prompts), `divergence` (first
differing position and the target's margin there), `report` (report.md, report.json, plots),
`stats` (the G-test against exact probabilities).
"""
