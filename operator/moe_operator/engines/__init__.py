"""One folder per engine (sglang/, vllm/, bundled/): each holds its accepted values (vocab.py), its
selection rows and split rules (plan.py), and its Engine object (engine.py). `vocabulary` gathers the
accepted values for the CRD (api.py); `registry` maps an engine name to its Engine for the planner.
The package itself imports nothing, so vocab modules load without the planning code."""
