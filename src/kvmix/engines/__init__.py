"""Engines beside kvmix's own and their formats: vLLM and llama.cpp started as server processes
or scoring runs, the cache formats each engine can hold, and the ``kv_plan.json`` kvmix exports
for them."""
