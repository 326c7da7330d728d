"""kvmix's pages inside vLLM's KV cache tensor.

A kvmix page is one encoded group (``group`` tokens × every KV head of a layer: the method's
``encode`` output, bit for bit) followed by the sequence's selection (PN-Mix's pairs, ...), so a
page is self-describing and safe to share through vLLM's prefix cache. A vLLM block of
``block_size`` tokens holds ``block_size / group`` pages (one for grouped methods, whose group
is the block; one per token for llama.cpp's per-token kinds).

vLLM hands each layer a uint8 tensor of ``num_blocks`` blocks and never reads inside it; the
plugin lays each layer's pages out field by field, as kvmix's own ``PagePool`` does: every
tensor of the page state becomes ``[pages, ...]``, a view into the layer's bytes. The fused
decode ops then read vLLM's cache exactly as they read kvmix's pool. (vLLM features that copy a
block's bytes — KV connectors, offloading, copy-on-write of hybrid models — would see a block as
a slice of every field; the plugin refuses them.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvmix.core.tree import map_tensors, tagged_tensors
from kvmix.methods import Blocks, Method, ModelSpec
from kvmix.runtime.plugin_settings import Refused


@dataclass
class Page:
    """What one page holds: the method's block state and the sequence's selection (None for
    methods that select nothing); every tensor ``[pages, ...]`` once laid out."""

    blocks: Blocks
    selection: Any


@dataclass(frozen=True)
class PageLayout:
    """The byte layout of one layer's pages: the page state of one page (``template``, tensors
    ``[1, ...]``). Fields are laid out widest element first, so each field's region starts on a
    multiple of its element size with no padding: a page takes exactly ``page_bytes``."""

    template: Page

    @property
    def fields(self) -> list[torch.Tensor]:
        return [t for _, t in tagged_tensors(self.template, "")]

    @property
    def page_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields)

    def views(self, cache: torch.Tensor, pages: int) -> Page:
        """The page state of ``pages`` pages laid out field by field in ``cache`` (a
        contiguous tensor of at least ``pages × page_bytes`` bytes): views, no copies."""
        flat = cache.view(torch.uint8).view(-1)
        if flat.numel() < pages * self.page_bytes:
            raise ValueError(f"kvmix: a layer's cache holds {flat.numel()} bytes; {pages} pages "
                             f"of {self.page_bytes} bytes need {pages * self.page_bytes}")
        fields = self.fields
        views: list[torch.Tensor | None] = [None] * len(fields)
        at = 0
        for i in sorted(range(len(fields)), key=lambda i: -fields[i].element_size()):
            t = fields[i]
            size = pages * t.numel() * t.element_size()
            views[i] = flat[at : at + size].view(t.dtype).view(pages, *t.shape[1:])
            at += size
        found = iter(views)
        return map_tensors(self.template, lambda _: next(found))


def page_layout(method: Method, spec: ModelSpec, layer: int, dtype: torch.dtype) -> PageLayout:
    """The page layout of ``method`` (bound to ``spec``) in ``layer``: one group of zeros
    encoded (the shapes and dtypes of its state) and the selection ``select_from`` makes."""
    keys = torch.zeros(1, spec.n_kv_heads, method.group, spec.head_dim, dtype=dtype)
    queries = torch.zeros(1, spec.n_heads, 1, spec.head_dim)
    try:  # a page's selection is made from the first group's query sums and tokens
        selection = method.select_from(method.query_sums(queries), torch.ones(1), keys, layer,
                                       keys)
    except NotImplementedError as error:
        raise Refused(f"{method.name} cannot select from a sequence's first group inside vLLM "
                      f"({error})") from error
    state = Blocks(*method.encode(keys, keys, layer, selection))
    return PageLayout(Page(state, selection))
