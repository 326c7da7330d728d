"""Primitives: bit packing, quantizers, transforms, importance scores, bit allocation and the
tensor walks behind batch ops and byte accounting. torch only: no transformers, no kvmix layer
above."""
