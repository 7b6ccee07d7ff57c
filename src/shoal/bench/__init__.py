"""shoal's benchmark suite: scenarios that run the same work on shoal and on Docker in one run.

`shoal bench [SCENARIO…]` (see `shoal.cli.bench`) runs them; results are JSON, PNG figures and a
table. Nothing here asserts timings: the figures are for reading (and for docs/benchmarks.md).
"""
