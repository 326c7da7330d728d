"""vLLM as an engine kvmix starts (in the vLLM environment, as a process): its OpenAI server for
``loadtest`` and ``serve --engine vllm``, and its scoring for ``compare --engine vllm``. The
plugin that runs inside it is ``kvmix.vllm``."""
