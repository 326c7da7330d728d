"""The runtime: the segment store and byte accounting of one layer, the transformers cache layer
and cache, the ``kvmix`` attention function, and value folding on model copies."""
