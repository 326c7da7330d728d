"""llama.cpp as an anchor beside kvmix: its build (``build``), its cache in bytes and slots
(``slots``), its server (``server``) and its Python bindings as a batch-1 decoder
(``decoder``)."""
