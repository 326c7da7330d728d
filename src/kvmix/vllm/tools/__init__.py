"""Command-line tools run in the vLLM environment (``python -m kvmix.vllm.tools.score``,
``python -m kvmix.vllm.tools.bench``): not plugin code, kept beside it because only
``kvmix.vllm`` may import vLLM."""
