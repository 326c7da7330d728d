"""One attention layer's kvmix cache inside vLLM: its pages (views into vLLM's KV tensor), the
float staging of each running sequence's open group, and a step's work on them.

The staging is a ``SlotArena``, the storage of kvmix's own sinks and residuals: one extent of
``group`` slots per running sequence, in the staging dtype.

A step (``StepPlan``, planned once for every layer) runs in three parts — with the CPU op, in
one call of ``kvmix::step`` (its seals in it where the method has a page encoding and no row's
first group is sealed; with ``prefill="exact"``, a step with a prompt's first chunk seals
before it and stages after it):

1. seal — every group completed this step (staged tokens and new ones) encoded in one
   call and written into its page; a row's first group first picks the row's selection from
   its tokens' queries and keys, later groups copy it from the first page;
2. attend — every token over the packed groups before its own (its pages) and its own group's
   floats up to it (staged, then new), as a decode at its position sees them: one call of
   kvmix's fused CPU op (on CUDA, its Triton kernels: two launches) over vLLM's block table
   for every decode and every prefill chunk's token. With the reference path (``kernels=
   "torch"``) decodes row by row and prefill chunks a block of whole groups at a time, pages
   decoded. With ``prefill="exact"``, a prompt's first chunk attends over its own tokens in
   float instead, as a float prefill;
3. stage — the new tokens of groups still open written to their staging slots (by the CPU
   op, once every row has read them, where no reference-path chunk reads the staging later).

With ``values="token"`` the staging holds keys only: each new token's values are encoded on
their own (``kvmix::put_values``, before the seal and the op) into their group's page,
where the op reads a row's own group's values; a seal encodes keys only.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvmix.core import fused
from kvmix.core.importance import selected_channels
from kvmix.core.quantizers import fused_encoding
from kvmix.core.tree import at_paths, map_tensors, tensor_paths
from kvmix.methods import Blocks
from kvmix.methods.base import PageEncoding, token_groups
from kvmix.runtime.accounting import open_groups_bytes
from kvmix.runtime.arena import SlotArena
from kvmix.runtime.inside_vllm import token_value_probes
from kvmix.runtime.kernels import Unserved, batch, choose, cpu, gpu
from kvmix.runtime.kernels.reference import sdpa
from kvmix.runtime.steps import Table
from kvmix.vllm.pages import Page, page_layout
from kvmix.vllm.plan import Chunk, KernelRows, Readers, StepPlan
from kvmix.vllm.settings import Refused, Settings

logger = logging.getLogger("vllm.kvmix")  # under vLLM's logger: in `vllm serve`'s log
SEALED = ([], [], [], None)  # kvmix::step's seal arguments where it seals nothing


@dataclass
class OpenGroups:
    """A layer's float staging: keys, values [1, H, slots · G, D] (each running sequence's open
    group, an extent each; keys only with ``values="token"``) and, where the method selects,
    query sums [slots, H, C]."""

    groups: SlotArena
    sums: torch.Tensor | None

    @classmethod
    def allocate(cls, settings: Settings, slots: int, device: torch.device) -> OpenGroups:
        method, spec = settings.method, settings.spec
        groups = SlotArena("the staging of a layer")
        groups.allocate(spec.n_kv_heads, slots * method.group, spec.head_dim,
                        settings.staging_dtype, device, fixed=True, values=settings.staged_values)
        groups.add([method.group] * slots)
        if groups.offset != [s * method.group for s in range(slots)]:  # what plans assume
            raise RuntimeError("kvmix: the staging's slots are not one group apart")
        probe = method.query_sums(torch.zeros(1, spec.n_heads, 1, spec.head_dim))
        sums = None if probe is None else probe.new_zeros(slots, *probe.shape[1:],
                                                          device=device)
        return cls(groups, sums)


class LayerCache:
    """kvmix's state of one attention layer (``layer``) inside vLLM."""

    def __init__(self, settings: Settings, layer: int, dtype: torch.dtype, slots: int,
                 block_size: int, device: torch.device, open_groups: OpenGroups | None = None):
        method, spec = settings.method, settings.spec
        self.method, self.layer, self.dtype = method, layer, dtype
        self.layout = page_layout(method, spec, layer, dtype)
        self.per_block, self.device = block_size // method.group, device
        self.head_dim = spec.head_dim
        open_groups = open_groups or OpenGroups.allocate(settings, slots, device)
        self.staging, self.sums = open_groups.groups, open_groups.sums
        self.pages: Page | None = None
        self.cache: torch.Tensor | None = None
        self.kernels = kernel_choice(settings, device)
        self.transforms = [name for name, heads in (("transform_queries", spec.n_heads),
                                                    ("transform_keys", spec.n_kv_heads))
                           if _changes(getattr(method, name), layer,
                                       torch.zeros(1, heads, 1, spec.head_dim, dtype=dtype,
                                                   device=device))]
        self.exact = settings.prefill == "exact"  # a prompt's first chunk attends in float
        self.staged_values = settings.staged_values  # else values go to pages as they arrive
        token = "" if self.staged_values else token_values_unserved(settings, device)
        if token:
            raise Refused(f"values='token' cannot be honoured: {token}")
        self._views: tuple[Any, batch.PoolView | None] = (None, None)
        self._selected = 0  # selections written so far: a page's may change when it is reused
        self.encoding = _page_encoding(method, layer, self.kernels, spec.head_dim)
        self._encoder = None if self.encoding is None else _op_encoding(self.encoding, dtype)

    # -- binding -------------------------------------------------------------------------------

    def bind(self, cache: torch.Tensor) -> None:
        """Lay the pages out in vLLM's tensor of this layer (once per tensor)."""
        if cache is self.cache:
            return
        if not cache.is_contiguous():
            raise ValueError("kvmix: vLLM's KV tensor of a layer is not contiguous; kvmix needs "
                             "the layer-major layout (VLLM_KV_CACHE_LAYOUT=LBHNC)")
        self.pages = self.layout.views(cache, cache.shape[0] * self.per_block)
        self.cache, self._views = cache, (None, None)
        template = self.layout.template  # each part's fields, and where a state holds them
        parts = {"blocks": (self.pages.blocks, template.blocks),
                 "keys": (self.pages.blocks.keys, template.blocks.keys),
                 "selection": (self.pages.selection, template.selection)}
        self._fields = {name: (at_paths(pages, tensor_paths(shape)), tensor_paths(shape))
                        for name, (pages, shape) in parts.items()}
        if self.encoding is not None:  # what encode_pages writes, in its order; selections
            keys, values = self.pages.blocks.keys, self.pages.blocks.values
            self._encoded = ([getattr(keys, name) for name in self.encoding.key_fields],
                             [values.codes, values.scale, values.minimum]
                             if self.staged_values else [], self._fields["selection"][0])
        if not self.staged_values:  # the pages' values as per-token groups (values="token")
            values = map_tensors(self.pages.blocks.values, lambda t: t.unsqueeze(0))
            self._value_groups = token_groups(values, self.head_dim // values.scale.shape[-2])

    def staging_bytes(self) -> int:
        """What the staging holds: each slot's open group (keys, and values unless
        ``values="token"``) and query sums."""
        sums = 0 if self.sums is None else self.sums.numel() * self.sums.element_size()
        return self.staging.nbytes() + sums

    # -- a step --------------------------------------------------------------------------------

    def step(self, plan: StepPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             scale: float, output: torch.Tensor) -> None:
        """query [N, Hq, D], key, value [N, H, D] of the step's tokens -> output [N, Hq, D].

        Every new key and value is taken as the staging holds it (in its dtype), whether it is
        staged, sealed or attended in this step: what a token is does not depend on how vLLM
        schedules it. Who writes what, in order: the seals gather staged and new tokens into
        pages; every row reads the staging; then the new tokens are staged (by the CPU op
        where ``plan.writes.by_op``, else here)."""
        plan.ran = True
        query = self._transformed(query, "transform_queries")  # [N, Hq, D]
        key = self._transformed(key, "transform_keys")
        sums = self._first_group_sums(plan, query)  # first groups fill over steps
        if not self.staged_values and plan.tokens:  # before any row reads its group's values
            self._put_values(plan, value)
        if plan.writes.by_op:  # the CPU op lays out and stages the tokens: none laid out here
            sealing = self._seal_here_or_in_op(plan, query, key, value, sums)
            self._attend(plan, query, (key, value), scale, output, sealing)
            return
        new = self._new_tokens(key, value)  # [2, H, N, D]
        kv = new.permute(2, 0, 1, 3)  # [N, 2, H, D] (a view)
        if plan.seals is not None:
            self._seal(plan, query, key, value, sums, kv)
        if plan.rows is not None:
            self._attend(plan, query, (key, value) if self.kernels == "cpu" else new, scale,
                         output)
        for chunk in plan.chunks:
            self._chunk(chunk, query, kv, scale, output)
        self._stage(plan, new)

    def _transformed(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x [N, h, D] through one of the method's transforms (they take [1, h, N, D]), where
        the method has one."""
        if name not in self.transforms:
            return x
        return getattr(self.method, name)(_heads_first(x), self.layer)[0].transpose(0, 1)

    def _new_tokens(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """key, value [N, H, D] -> [2, H, N, D] in the staging dtype (contiguous: the kernels
        read the kernel rows' new tokens in it)."""
        N, H, D = key.shape
        new = torch.empty(2, H, N, D, dtype=self.staging.dtype, device=key.device)
        new[0].copy_(key.transpose(0, 1))
        new[1].copy_(value.transpose(0, 1))
        return new

    # -- attend --------------------------------------------------------------------------------

    def _attend(self, plan: StepPlan, query, tokens, scale: float, output,
                sealing: tuple = SEALED) -> None:
        """Every kernel row (a decode's token, a fused chunk's tokens) in one call of the fused
        kernels (or, without them, row by row), each reading its own group's floats where they
        lie (``KernelRows.floats``): the staging, then the step's ``tokens`` — laid out
        [2, H, N, D] in the staging dtype, or, for the CPU op to lay out, (key, value)
        [N, H, D]. The CPU op's call (``kvmix::step``) first seals the step's groups where
        ``sealing`` says how (``_seal_here_or_in_op``), and stages the new tokens where
        ``plan.writes.by_op``."""
        rows = plan.rows
        if self.kernels == "torch":
            for k, token in enumerate(rows.tokens.tolist()):
                self._reference(rows, k, token, query, tokens, scale, output)
            return
        pool = self._pool_view(plan)
        queries = query if rows.every_token else query[rows.tokens]  # [K, Hq, D]
        if self.kernels == "triton":
            queries = queries.float().contiguous()
            table = Table(rows.table, rows.held, rows.counts, rows.table.shape[1])
            out = gpu.decode_pages(pool, table, queries, scale, self.method.group,
                                   (self.staging.keys, self.staging.values, rows.floats),
                                   step=(tokens[0:1], tokens[1:2]))
        else:
            in_place = rows.every_token and output.dtype == torch.float32 \
                and output.is_contiguous()  # the op writes vLLM's output: no copy
            # with values="token" the staging holds keys only: the values passed are the keys
            # again, never read (each row's own values are read from its page)
            values = self.staging.values if self.staged_values else self.staging.keys
            out = cpu.call("step", cpu.query_rows(queries), scale, self.staging.keys, values,
                           rows.step_rows, *tokens, cpu.page_pool(pool), *sealing,
                           out=output if in_place else None)
            if in_place:
                return
        if rows.every_token:
            output.copy_(out)
        else:
            output[rows.tokens] = out.to(output.dtype)

    def _reference(self, rows: KernelRows, k: int, token: int, query, new: torch.Tensor,
                   scale, output) -> None:
        """Kernel row ``k`` (the step's token ``token``) through the reference path: its pages
        decoded, then its own group's floats, staged and new."""
        pages = rows.table[k, : int(rows.counts[k])].tolist()
        staged_at, staged, new_at, count = rows.floats[k].tolist()
        floats = [torch.cat([held[:, :, staged_at : staged_at + staged],
                             laid[:, :, new_at : new_at + count]], -2).float()
                  for held, laid in ((self.staging.keys, new[0:1]),
                                     (self.staging.values, new[1:2]))]
        first = None if rows.first_pages is None else rows.first_pages[k]
        history = self._history(pages, first, torch.float32)
        keys, values = (torch.cat([h, x], dim=-2) for h, x in zip(history, floats, strict=True))
        out = sdpa(_heads_first(query[token : token + 1]).float(), keys, values, scale)
        output[token] = out[0, :, 0].to(output.dtype)

    def _chunk(self, chunk: Chunk, query, kv, scale: float, output) -> None:
        """A row of several new tokens: each sees the groups before its own packed (decoded
        pages) and its own group's tokens up to it as floats (staged, then the chunk's). With
        ``prefill="exact"`` a prompt's first chunk sees itself in float, as a float prefill
        does."""
        new = slice(chunk.start, chunk.stop)
        keys, values = (_heads_first(kv[new, i]).float() for i in (0, 1))  # [1, H, n, D]
        query = _heads_first(query[new]).float()  # [1, Hq, n, D]
        if self.exact and chunk.before == 0:
            out = sdpa(query, keys, values, scale)  # causal
        else:
            out = self._as_decodes(chunk, query, keys, values, scale)
        output[new] = out[0].transpose(0, 1).to(output.dtype)

    def _as_decodes(self, chunk: Chunk, query, keys, values, scale: float) -> torch.Tensor:
        """query [1, Hq, n, D] of a chunk over its row's history, as decodes at the chunk's
        positions see it, keys, values [1, H, n, D] its own -> [1, Hq, n, D]; block by block
        (``Chunk.blocks``), each over the decoded groups its queries see and its own floats."""
        staged = chunk.before % self.method.group
        if staged:
            held = [x[None, :, :staged].float() for x in self.staging.views(chunk.slot)]
            keys, values = torch.cat([held[0], keys], -2), torch.cat([held[1], values], -2)
        history = self._history(chunk.pages, chunk.first, torch.float32)  # [1, H, P·G, D]
        outputs = []
        for b in chunk.blocks:
            seen = [torch.cat([old[:, :, : b.packed], new[:, :, b.first : b.last]], -2)
                    for old, new in zip(history, (keys, values), strict=True)]
            outputs.append(sdpa(query[:, :, b.start : b.stop], *seen, scale, b.mask))
        return torch.cat(outputs, -2)

    def _history(self, pages: list[int], first: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """A row's pages decoded: keys, values [1, H, n·G, D]."""
        if not pages:
            _, H, _, D = self.staging.keys.shape
            empty = self.staging.keys.new_zeros(1, H, 0, D, dtype=dtype)
            return empty, empty
        index = torch.tensor(pages, device=self.device)
        blocks = map_tensors(self.pages.blocks, lambda t: t.index_select(0, index).unsqueeze(0))
        keys, values = self.method.decode(blocks, self.layer, self._selection([first]), dtype)
        return tuple(x.transpose(1, 2).flatten(2, 3) for x in (keys, values))

    def _selection(self, pages: list[int] | torch.Tensor) -> Any:
        """The selection stored in ``pages`` (batch dimension: one per page), or None."""
        if self.pages.selection is None:
            return None
        index = torch.as_tensor(pages, device=self.device)
        return map_tensors(self.pages.selection, lambda t: t.index_select(0, index))

    def _pool_view(self, plan: StepPlan) -> batch.PoolView:
        """The pool as the kernels read it, with each decode row's selection (rebuilt only when
        the rows' first pages, or the selections stored, change). Without selections the CPU
        op reads one for every row; the Triton kernels index a row's own."""
        rows = plan.rows.count if self.kernels == "triton" else 1
        firsts = None if self.pages.selection is None else plan.rows.first_pages
        key = (self._selected, firsts, rows)
        if self._views[0] != key or self._views[1] is None:
            pool = map_tensors(self.pages.blocks, lambda t: t.unsqueeze(0))
            self._views = key, batch.build_pool_view(self.method, self.layer, pool,
                                                     self._row_selections(firsts, rows))
        return self._views[1]

    def _row_selections(self, firsts: tuple[int, ...] | None, rows: int) -> list[Any]:
        """Each kernel row's selection, one object per distinct first page (fetched in one
        ``index_select``): rows of one sequence share it, and so its kernel view."""
        if firsts is None:
            return [None] * rows
        pages = list(dict.fromkeys(firsts))
        chosen = self._selection(pages)  # [U, ...]
        by_page = {page: map_tensors(chosen, lambda t, i=i: t[i : i + 1])
                   for i, page in enumerate(pages)}
        return [by_page[page] for page in firsts]

    # -- seal and stage ------------------------------------------------------------------------

    def _seal_here_or_in_op(self, plan: StepPlan, query, key, value,
                            sums: torch.Tensor | None) -> tuple:
        """How the CPU op's ``kvmix::step`` seals the step's groups: (key fields, value fields,
        selection fields, encoding) where it encodes them into their pages itself (each copies
        its row's selection from its first page there); else nothing, the groups sealed here
        first (a method without a page encoding; a row's first group sealed now, whose
        selection is chosen from its tokens)."""
        seals = plan.seals
        if seals is None:
            return SEALED
        if self.encoding is None or (self.pages.selection is not None and seals.selects):
            self._seal(plan, query, key, value, sums)
            return SEALED
        return (*self._encoded, self._encoder)

    def _seal(self, plan: StepPlan, query, key, value, sums: torch.Tensor | None,
              kv: torch.Tensor | None = None) -> None:
        """Encode every group completed this step into its page, in one call (its keys only
        with ``values="token"``: its values are in the page already); key, value [N, H, D] the
        step's tokens (``kv`` [N, 2, H, D]: laid out in the staging dtype, where they are)."""
        groups = self._groups(plan, key, value, kv)  # [2 (1: keys only), E, H, G, D]
        keys, values = groups[0], groups[1] if self.staged_values else None
        selection = None
        if self.pages.selection is not None:
            self._select(plan, sums, keys, values)
            if self.exact:
                self._select_prefills(plan, query, kv)
            selection = self._selection(plan.seals.first_pages)
            self._write("selection", selection, plan.seals.pages)  # self-describing pages
        if self.encoding is not None:
            self._encode_pages(groups, plan.seals.pages, selection)
            return
        with fused_encoding(self.kernels):  # kvmix's own runtime encodes in its kernels too
            # (keys only: encode's values of the keys themselves are computed and dropped)
            sealed = Blocks(*self.method.encode(keys, keys if values is None else values,
                                                self.layer, selection))
        if values is None:
            self._write("keys", sealed.keys, plan.seals.pages)
        else:
            self._write("blocks", sealed, plan.seals.pages)

    def _encode_pages(self, groups: torch.Tensor, pages: torch.Tensor, selection: Any) -> None:
        """groups [2 (1: keys only), E, H, G, D] encoded by the CPU op straight into entries
        ``pages`` [E] of the pages, as ``encode`` and ``_write`` would store them."""
        encoding, channels, index = self.encoding, self.encoding.channels, None
        if channels is not None:  # the high channels [E, H, k] of their selection
            with fused_encoding("cpu"):
                index = selected_channels(selection.bits, self.staging.keys.shape[1],
                                          channels.units, channels.pairs, channels.count)
        cpu.call("encode_pages", *self._encoded[:2], groups, pages, index, encoding.low_bits,
                 encoding.high_bits, encoding.center, encoding.value_bits, encoding.value_group)

    def _write(self, part: str, state: Any, pages: torch.Tensor) -> None:
        """``state`` (tensors [E, ...], shaped as the pages' ``part``: ``blocks``, their
        ``keys`` or the ``selection``) into entries ``pages`` [E] of that part, field by field:
        one call of the op library with the CPU op, else a copy a field."""
        fields, paths = self._fields[part]
        states = at_paths(state, paths)
        if self.kernels == "cpu":
            cpu.call("write_pages", fields, states, pages)
            return
        for field, tensor in zip(fields, states, strict=True):
            field.index_copy_(0, pages, tensor.to(field.dtype))

    def _groups(self, plan: StepPlan, key, value, kv: torch.Tensor | None) -> torch.Tensor:
        """The sealed groups' tokens, staged and new: keys, values [2, E, H, G, D] in the
        model's dtype ([1, E, H, G, D], keys only, with ``values="token"``; a view of a
        token-major buffer, every token of it written). The op library gathers them from the
        staging and key, value [N, H, D] (rounded to the staging dtype) with the CPU op; the
        other paths from the staging and the step's tokens laid out, ``kv`` [N, 2, H, D]."""
        seals, G = plan.seals, self.method.group
        if self.kernels == "cpu":
            return cpu.call("seal_tokens", self.staging.keys, self.staging.values, key, value,
                            seals.carried, seals.carried_at, seals.tokens, seals.tokens_at,
                            seals.count, G, self.dtype)
        (_, H, _, D) = self.staging.keys.shape
        staged = self.staging.take(seals.carried)  # keys (and values) [c, H, D]
        n = len(staged)
        tokens = kv.new_empty(seals.count * G, n, H, D, dtype=self.dtype)  # [E·G, n, H, D]
        tokens.index_copy_(0, seals.carried_at, torch.stack(staged, 1).to(self.dtype))
        tokens.index_copy_(0, seals.tokens_at, kv[seals.tokens, :n].to(self.dtype))
        return tokens.view(seals.count, G, n, H, D).permute(2, 0, 3, 1, 4)

    def _put_values(self, plan: StepPlan, value: torch.Tensor) -> None:
        """value [N, H, D] of the step's tokens, rounded as the staging rounds them, encoded
        token by token into their groups' pages (``values="token"``: ``kvmix::put_values``,
        the op library's per-token encoder, as ``Method.token_values`` encodes them)."""
        groups = self._value_groups
        cpu.call("put_values", groups.codes, groups.scale, groups.minimum, value,
                 self.staging.dtype, plan.writes.value_at, groups.bits, groups.group,
                 self.method.group)

    def _select(self, plan: StepPlan, sums: torch.Tensor | None, keys: torch.Tensor,
                values: torch.Tensor | None) -> None:
        """Selections of the rows whose first group is sealed now, into their first pages."""
        if not plan.seals.selects:
            return
        first = plan.seals.firsts
        tokens = torch.full((len(first),), float(self.method.group), device=keys.device)
        chosen = self.method.select_from(None if sums is None else sums[first], tokens,
                                         keys[first], self.layer,
                                         None if values is None else values[first])
        self._write("selection", chosen, plan.seals.pages[first])
        self._selected += 1

    def _select_prefills(self, plan: StepPlan, query, kv) -> None:
        """With ``prefill="exact"``, a float prefill selects as kvmix's own cache does at a
        prompt: from every token of a prompt's first chunk (one group or more), not only its
        first group."""
        for chunk in plan.chunks:
            if chunk.before or chunk.stop - chunk.start < self.method.group:
                continue
            new = slice(chunk.start, chunk.stop)
            keys, values = (_heads_first(kv[new, i]).to(self.dtype) for i in (0, 1))
            chosen = self.method.select(_heads_first(query[new]), keys, self.layer, values)
            self._write("selection", chosen, torch.tensor([chunk.first], device=self.device))
            self._selected += 1

    def _first_group_sums(self, plan: StepPlan, query: torch.Tensor) -> torch.Tensor | None:
        """Query sums of first groups: per sealed group [E, H, C], its slot's and its new
        tokens'; the new tokens of first groups still open added to their slots (restarted
        where a group opens: a slot sealed now may open another row's group)."""
        if self.sums is None or plan.sums is None:  # no first group's token
            return None
        sums = plan.sums
        new = self.method.query_sums(query[sums.tokens].unsqueeze(2))
        sealed = self.sums.new_zeros(plan.sealed, *self.sums.shape[1:])
        sealed.index_add_(0, sums.into[sums.sealed], new[sums.sealed])
        if plan.seals is not None:
            carried = sums.carried >= 0
            sealed[plan.seals.firsts[carried]] += self.sums[sums.carried[carried]]
        self.sums.index_fill_(0, sums.restart, 0.0)
        self.sums.index_add_(0, sums.into[~sums.sealed], new[~sums.sealed])
        return sealed

    def _stage(self, plan: StepPlan, new: torch.Tensor) -> None:
        """The new tokens [2, H, N, D] of groups still open into their slots."""
        writes = plan.writes
        if not writes.all_staged:
            new = new[:, :, writes.staged]  # [2, H, n, D]
        self.staging.put(writes.staged_at, *new.transpose(1, 2))


def readers(settings: Settings, block_size: int, device: torch.device) -> Readers:
    """What reads the plans of an engine with ``settings`` (``Readers``)."""
    method, spec = settings.method, settings.spec
    probe = method.query_sums(torch.zeros(1, spec.n_heads, 1, spec.head_dim))
    selects = any(page_layout(method, spec, layer, settings.dtype).template.selection is not None
                  for layer in range(spec.n_layers))
    return Readers(method.group, block_size, kernel_choice(settings, device),
                   settings.prefill == "exact", not settings.staged_values, probe is not None,
                   selects)


def _page_encoding(method, layer: int, kernels: str, head_dim: int) -> PageEncoding | None:
    """How the CPU op encodes ``method``'s sealed groups straight into their pages
    (``kvmix::encode_pages``), or None: ``encode`` then ``_write`` (another kernel choice, a
    method without a page encoding, groups the op's encoder does not take)."""
    encoding = method.page_encoding(layer) if kernels == "cpu" else None
    if encoding is None:
        return None
    groups = (method.group, encoding.value_group)
    takes = all(8 <= n <= fused.CPU_MAX_GROUP and n & (n - 1) == 0 for n in groups)
    units = encoding.channels is None or encoding.channels.units % 8 == 0  # whole bytes a head
    return encoding if takes and units and head_dim % encoding.value_group == 0 else None


def _op_encoding(encoding: PageEncoding, dtype: torch.dtype) -> Any:
    """``encoding`` as ``kvmix::step`` reads it (``PageEncoding``), groups encoded from their
    tokens in the layer's ``dtype``."""
    channels = encoding.channels
    return torch.classes.kvmix.PageEncoding(
        encoding.low_bits, encoding.high_bits, encoding.center, encoding.value_bits,
        encoding.value_group, 0 if channels is None else channels.units,
        None if channels is None or channels.pairs is None else channels.pairs.long().contiguous(),
        0 if channels is None else channels.count, dtype)


def _changes(transform, layer: int, probe: torch.Tensor) -> bool:
    """Whether a method's transform of queries or keys (``probe`` [1, h, 1, D], on the layer's
    device) changes them: its identity, a method's default or a setting that turns it off,
    returns its input."""
    return transform(probe, layer) is not probe


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[n, h, D] -> [1, h, n, D]"""
    return x.transpose(0, 1).unsqueeze(0)


def staging_nbytes(settings: Settings, slots: int) -> int:
    """What every layer's staging holds for ``slots`` running sequences: the open group's keys
    and values (keys only with ``values="token"``) in the staging dtype, and where the method
    selects, its query sums."""
    return open_groups_bytes(settings.method, settings.spec, settings.staging_dtype, slots,
                             settings.staged_values)


@functools.cache
def kernel_choice(settings: Settings, device: torch.device) -> str:
    """The kernels decode rows go through for ``settings`` on ``device`` (the runtime's
    ``choose``), decided once per engine: a warning names why the reference path runs where
    ``auto`` falls back to it; kernels asked for by name that cannot read the cache are
    ``Refused``."""
    try:
        choice, reason = choose(settings.kernels, settings.method, settings.spec.head_dim,
                                settings.dtype, device)
    except Unserved as error:
        raise Refused(str(error)) from error
    if reason:
        logger.warning("kvmix: decode through the reference path: %s", reason)
    return choice


def token_values_unserved(settings: Settings, device: torch.device) -> str:
    """Why ``values="token"`` cannot run with ``settings`` on ``device`` ("" when it can): the
    CPU op alone reads a row's own values from its page, and its encoder quantizes groups of a
    power of two from 8 to 256 channels."""
    chosen = kernel_choice(settings, device)
    if chosen != "cpu":
        return (f"a row's own values are read from its page by kvmix's CPU op only (kernels: "
                f"{chosen})")
    for probe in token_value_probes(settings.method, settings.spec):
        if probe is None:
            return f"{settings.method.name}'s values are not per-token groups"
        group = probe.shape[-1]
        if group & (group - 1) or not 8 <= group <= fused.CPU_MAX_GROUP:
            return (f"value groups of {group} channels (the CPU op's encoder takes a power of "
                    f"two from 8 to {fused.CPU_MAX_GROUP})")
    return ""

