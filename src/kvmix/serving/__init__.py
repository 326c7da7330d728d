"""Serving many users: continuous batching on transformers' machinery with kvmix's packed pool
(``paged``), admission by bytes (``budget``), and the OpenAI-compatible server (``server``)."""
