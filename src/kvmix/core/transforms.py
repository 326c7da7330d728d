"""Orthogonal transforms applied to keys and values before quantization."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def hadamard(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix [n, n] (orthogonal, symmetric); n a power of 2."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size; got {n}")
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < n:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return (matrix / n**0.5).to(dtype)


def walsh_hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., D] times the unnormalized Sylvester Hadamard matrix of each ``block`` channels
    (H·H = block·I), by the butterfly: additions only, so each row's result is the same whatever
    the batch around it (a matmul's rounding depends on its shape)."""
    if block < 1 or block & (block - 1) or x.shape[-1] % block:
        raise ValueError(f"a Hadamard block must be a power of two dividing {x.shape[-1]}; "
                         f"got {block}")
    shape = x.shape
    x = x.reshape(-1, block)
    h = 1
    while h < block:
        pairs = x.view(-1, block // (2 * h), 2, h)
        x = torch.stack([pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]],
                        dim=2).view(-1, block)
        h *= 2
    return x.view(shape)


KINDS = ("identity", "hadamard", "wus", "wush")


def block_transform(sigma: torch.Tensor, weight: torch.Tensor, kind: str, block: int,
                    damping: float) -> torch.Tensor:
    """The block-diagonal transform T [D, D] (float64) for a quantized factor x with second
    moment ``sigma`` [D, D] multiplied by ``weight`` [m, D] (WUSH-KV, arXiv:2609.38121):

    ``UᵀU = Σ + λI`` (upper Cholesky), ``U Wᵀ = V S Yᵀ`` (SVD), ``T = H·diag(s^½)·Vᵀ·U^{−ᵀ}``;
    ``wus`` omits H. λ = ``damping`` × the block's mean diagonal, so a singular moment works,
    and singular values below ``damping`` × the largest are raised to it, so T stays invertible.
    """
    if kind not in KINDS:
        raise ValueError(f"transform={kind!r} is invalid; valid: {', '.join(KINDS)}")
    dim = sigma.shape[-1]
    if dim % block:
        raise ValueError(f"block={block} must divide the head dim {dim}")
    blocks = [_one_block(sigma[s:s + block, s:s + block].double(),
                         weight[:, s:s + block].double(), kind, damping)
              for s in range(0, dim, block)]
    return torch.block_diag(*blocks)


def _one_block(sigma: torch.Tensor, weight: torch.Tensor, kind: str,
               damping: float) -> torch.Tensor:
    size = sigma.shape[0]
    if kind == "identity":
        return torch.eye(size, dtype=torch.float64)
    if kind == "hadamard":
        return hadamard(size, torch.float64)
    damped = sigma + damping * sigma.diagonal().mean().clamp_min(1e-12) * torch.eye(
        size, dtype=torch.float64)
    upper = torch.linalg.cholesky(damped, upper=True)  # UᵀU = Σ + λI
    product = upper @ weight.T  # [b, m]
    # U Wᵀ = V S Yᵀ with V square: Y is never used, so it is computed whole (m × m: 1728 × 1728
    # for a 576-wide output projection) only where W is thinner than the block
    left, singular, _ = torch.linalg.svd(product, full_matrices=product.shape[1] < size)
    singular = torch.cat([singular, singular.new_zeros(size - singular.numel())])
    singular = singular.clamp_min(damping * singular.max())  # keep T invertible when W is thin
    inverse = torch.linalg.solve_triangular(upper, torch.eye(size, dtype=torch.float64),
                                            upper=True)  # U^{-1}
    transform = torch.diag(singular.sqrt()) @ left.T @ inverse.T  # diag(s^½)·Vᵀ·U^{-ᵀ}
    return hadamard(size, torch.float64) @ transform if kind == "wush" else transform


# -- calibrated transforms on disk ----------------------------------------------------------
@dataclass
class TransformSet:
    """Per (layer, KV head) block-diagonal transforms of every kind, float64 [L, H, D, D]:
    ``keys[kind]`` is T_k (k' = T_k k), ``values[kind]`` is T_v (v' = T_v v)."""

    keys: dict[str, torch.Tensor]
    values: dict[str, torch.Tensor]
    meta: dict[str, str]

    def __post_init__(self) -> None:
        self.meta = {**self.meta, "checksum": checksum(self.tensors())}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{side}.{kind}": t.contiguous() for side in ("keys", "values")
                for kind, t in getattr(self, side).items()}

    @property
    def checksum(self) -> str:
        return self.meta["checksum"]


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def save_transforms(path: str | Path, transforms: TransformSet) -> Path:
    save_file(transforms.tensors(), str(path), metadata=transforms.meta)
    return Path(path)


def load_transforms(path: str | Path) -> TransformSet:
    """Read and verify a transforms file (its checksum, and invariants in float64)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"transforms={str(path)!r}: no such file (make one with kvmix calibrate)")
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    split = {side: {name.split(".", 1)[1]: t for name, t in tensors.items()
                    if name.startswith(side + ".")} for side in ("keys", "values")}
    loaded = TransformSet(split["keys"], split["values"], meta)
    if meta.get("checksum") != loaded.checksum:
        raise ValueError(f"transforms={str(path)!r}: checksum mismatch, the file is damaged")
    for side in ("keys", "values"):
        for kind, matrix in split[side].items():
            check_invertible(matrix, f"{side}.{kind}")
    return loaded


def check_invertible(matrix: torch.Tensor, name: str, tolerance: float = 1e-8) -> None:
    """T⁻¹·T = I in float64 for every (layer, head), or a clear error."""
    eye = torch.eye(matrix.shape[-1], dtype=torch.float64)
    error = (torch.linalg.inv(matrix.double()) @ matrix.double() - eye).abs().max().item()
    if error > tolerance:
        raise ValueError(f"transform {name} is not invertible to {tolerance}: |T⁻¹T − I| = "
                         f"{error:.2e}")


# -- serving artifacts: per-(layer, KV head, block) right-multipliers --------------------------
def right_multipliers(transforms: TransformSet, transform: str) -> dict[str, torch.Tensor]:
    """Per (layer, KV head, block): [L, H, D/block, block, block] float64."""
    block = int(transforms.meta["block"])
    t_k, t_v = transforms.keys[transform].double(), transforms.values[transform].double()
    full = {"k_right": t_k.transpose(-1, -2), "q_right": torch.linalg.inv(t_k),
            "v_right": t_v.transpose(-1, -2), "o_right": torch.linalg.inv(t_v).transpose(-1, -2)}
    return {name: _blocks(matrix, block) for name, matrix in full.items()}


def save_multipliers(path: Path, transforms: TransformSet, transform: str) -> Path:
    meta = {**transforms.meta, "transform": transform,
            "layout": "[layer, kv_head, block_index, block, block]; x' = x @ right per block"}
    save_file({k: v.contiguous() for k, v in right_multipliers(transforms, transform).items()},
              str(path), metadata=meta)
    return path


def _blocks(matrix: torch.Tensor, block: int) -> torch.Tensor:
    count = matrix.shape[-1] // block
    return torch.stack([matrix[..., i * block:(i + 1) * block, i * block:(i + 1) * block]
                        for i in range(count)], dim=2)
