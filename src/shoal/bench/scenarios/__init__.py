"""The benchmark scenarios: one module each, defining `SCENARIO` (see `shoal.bench.scenario`), listed in
`shoal.bench.registry`. Helper modules shared by several scenarios live here too (`common`)."""
