"""Float slots of many rows in one arena (docs/design/cache-layout.md): the sink and residual of
kvmix's own cache (``BatchStore``) and the open groups staged by its vLLM plugin
(``kvmix.vllm.layer``) live in this one storage.

Keys and values are one tensor each, [1, H, N, D] in the slot dtype (``Method.slot_dtype``:
float16 for a quantizing method in a float32 model, or the plugin's ``staging``). Row b owns
the extent ``[offset[b], offset[b] + capacity[b])``. Extents are placed first fit in the gaps
rows leave; when none fits, the rows are compacted and the arena grows, unless it is ``fixed``
(a server's budget, the plugin's slots): then the row is refused. An arena of keys only
(``values`` None) stages the keys of the plugin's ``values="token"``, whose values go to their
pages as they arrive. A kernel reads the rows'
slots in place, through absolute positions (``spans`` of the fused decode op).
"""

from __future__ import annotations

import itertools

import torch

from kvmix.core.memory import storage_bytes


def token_bytes(heads: int, head_dim: int, dtype: torch.dtype, values: bool = True) -> int:
    """One token's keys (and values) in a slot of ``dtype``."""
    return (1 + values) * heads * head_dim * dtype.itemsize


class SlotArena:
    """Extents of rows in one pair of tensors ``keys``, ``values`` [1, H, N, D] (None before
    ``allocate``; ``values`` None in an arena of keys only). ``name`` places an error
    ("layer 3")."""

    def __init__(self, name: str):
        self.name = name
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.offset: list[int] = []  # per row, where its extent starts
        self.capacity: list[int] = []  # per row, its slots
        self.fixed = False  # whether the arena keeps its size
        self._positions: dict[torch.device, torch.Tensor] = {}  # offsets on a device

    def allocate(self, heads: int, slots: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, fixed: bool = False, values: bool = True) -> None:
        """An empty arena of ``slots`` slots and no rows (``fixed``: it never grows;
        ``values``: False for keys only)."""
        shape = (1, heads, slots, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device) if values else None
        self.offset, self.capacity, self.fixed = [], [], fixed
        self._moved()

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def slots(self) -> int:
        """Slots the arena holds (rows' or free)."""
        return self.keys.shape[2] if self.keys is not None else 0

    @property
    def rows(self) -> int:
        return len(self.offset)

    def extent(self, b: int) -> slice:
        return slice(self.offset[b], self.offset[b] + self.capacity[b])

    def views(self, b: int) -> tuple[torch.Tensor, ...]:
        """Row ``b``'s extent: keys, values [H, capacity, D] (views; keys alone in an arena
        of keys only)."""
        extent = self.extent(b)
        return tuple(arena[0, :, extent] for arena in self.tensors())

    # -- rows ----------------------------------------------------------------------------------

    def add(self, sizes: list[int]) -> None:
        """Rows of ``sizes`` slots after the last, placed first fit (no other row's slots are
        copied unless the rows are compacted: then every offset may change)."""
        gaps, offsets = self._gaps(), []
        for size in sizes:
            at = next((i for i, (_, length) in enumerate(gaps) if length >= size), None)
            if at is None:
                offsets = self._compacted(sizes)
                break
            start, length = gaps[at]
            offsets.append(start)
            gaps[at] = (start + size, length - size)
        self.offset += offsets
        self.capacity += sizes
        self._moved()

    def remove(self, b: int) -> None:
        """Row ``b`` leaves: its extent is free and the last row takes its index."""
        for rows in (self.offset, self.capacity):
            rows[b] = rows[-1]
            rows.pop()
        self._moved()

    def copy(self, source: int, target: int) -> None:
        """Row ``target``'s slots become a copy of row ``source``'s (same capacity)."""
        for arena in self.tensors():
            arena[..., self.extent(target), :] = arena[..., self.extent(source), :]

    def resize(self, slots: int, fixed: bool = True) -> None:
        """Exactly ``slots`` slots (at least the rows' extents), the rows compacted into them;
        ``fixed``: the arena never grows (``add`` beyond it is refused)."""
        if slots < sum(self.capacity):
            raise ValueError(f"slots={slots} is below the {sum(self.capacity)} slots the rows "
                             f"hold ({self.name})")
        if self.keys is not None:
            self.pick(list(range(self.rows)), slots)
        self.fixed = fixed

    def pick(self, rows: list[int], slots: int | None = None) -> None:
        """A new arena (``slots`` slots; by default as many as now, or the rows' extents if
        more) holding the extents of ``rows`` (in that order, a row may repeat) contiguous from
        0; they become the rows."""
        offsets = list(itertools.accumulate((self.capacity[b] for b in rows), initial=0))
        slots = max(self.slots, offsets[-1]) if slots is None else slots
        fresh = []
        for arena in self.tensors():
            new = arena.new_zeros((*arena.shape[:2], slots, arena.shape[3]))
            for at, b in zip(offsets[:-1], rows, strict=True):
                new[:, :, at : at + self.capacity[b]] = arena[:, :, self.extent(b)]
            fresh.append(new)
        self.keys, self.values = fresh[0], fresh[1] if self.values is not None else None
        self.offset, self.capacity = offsets[:-1], [self.capacity[b] for b in rows]
        self._moved()

    def _gaps(self) -> list[tuple[int, int]]:
        """(start, length) of the arena's free stretches, in order."""
        gaps, at = [], 0
        for start, size in sorted(zip(self.offset, self.capacity, strict=True)):
            gaps.append((at, start - at))
            at = start + size
        return [*gaps, (at, self.slots - at)]

    def _compacted(self, sizes: list[int]) -> list[int]:
        """The rows compacted (the arena grown unless fixed) -> offsets of new extents of
        ``sizes`` after them."""
        used = sum(self.capacity)
        need = used + sum(sizes)
        if self.fixed and need > self.slots:
            raise ValueError(f"the float slots are full: {used} of {self.slots} slots in use "
                             f"and {sum(sizes)} more needed ({self.name})")
        self.pick(list(range(self.rows)), self.slots if need <= self.slots else max(
            need, self.slots * 5 // 4))
        return list(itertools.accumulate(sizes, initial=used))[:-1]

    def _moved(self) -> None:
        self._positions = {}

    # -- tokens by absolute position -----------------------------------------------------------

    def positions(self, rows: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
        """Absolute positions of slots ``within`` the extents of ``rows`` (same shape, on their
        device)."""
        device = rows.device
        if device not in self._positions:
            self._positions[device] = torch.tensor(self.offset, dtype=torch.long, device=device)
        return self._positions[device][rows] + within

    def take(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Keys, values [*positions.shape, H, D] at ``positions`` (a copy; keys alone in an
        arena of keys only)."""
        return tuple(arena[0].transpose(0, 1)[positions] for arena in self.tensors())

    def put(self, positions: torch.Tensor, keys: torch.Tensor,
            values: torch.Tensor | None = None) -> None:
        """keys, values [n, H, D] into ``positions`` [n] (rounded to the slot dtype; values
        ignored by an arena of keys only)."""
        if values is None and self.values is not None:
            raise ValueError(f"values to put are missing: the arena stages them ({self.name})")
        # [N, H, D] <- [n, H, D]
        for arena, new in zip(self.tensors(), (keys, values), strict=False):
            arena[0].transpose(0, 1).index_copy_(0, positions, new.to(arena.dtype))

    def move(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Slots ``source`` copied to ``target`` (same shape; read before written)."""
        for arena in self.tensors():
            arena[0][:, target] = arena[0][:, source]

    # -- bytes and devices ---------------------------------------------------------------------

    def nbytes(self) -> int:
        """What the arena keeps alive: its tensors' storages."""
        return sum(storage_bytes(t) for t in self.tensors())

    def token_bytes(self) -> int:
        return token_bytes(self.keys.shape[1], self.keys.shape[3], self.keys.dtype,
                           self.values is not None)

    def tensors(self) -> list[torch.Tensor]:
        """The arena's tensors: keys, then values where it holds them."""
        return [t for t in (self.keys, self.values) if t is not None]

    def to(self, device: torch.device | str) -> None:
        if self.keys is not None:
            self.keys, self.values = (None if t is None else t.to(device, non_blocking=True)
                                      for t in (self.keys, self.values))
        self._moved()
