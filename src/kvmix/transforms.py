"""Orthogonal transforms applied to keys and values before quantization."""

from __future__ import annotations

import torch


def hadamard(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix [n, n] (orthogonal, symmetric); n a power of 2."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size; got {n}")
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < n:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return (matrix / n**0.5).to(dtype)
