"""The CPU op's integer path at production shapes (32 query heads over 8 KV heads of dimension
128, groups of 32, 64 and 128 tokens, every code width) against the reference path.

The integer path rounds the float weights it dots with codes (the pre-scaled query per key
block, p·scale per value group) to 16 bits relative to each block's largest weight; the stated
tolerance (``helpers.INTEGER_TOLERANCE``) is 2e-3 of the output's largest magnitude. The
rounding measures 2-8e-4 a step here, 1.3e-3 at most over a run's 66 steps. Without the lower
int8 plane it would be 5-8e-2."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import INTEGER_TOLERANCE, PRODUCTION_METHODS, compare_production

from kvmix.runtime.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available()[0], reason="the CPU op is not built")

INTEGER = all(flag in Path("/proc/cpuinfo").read_text().split() for flag in cpu.INTEGER_FLAGS) \
    if Path("/proc/cpuinfo").exists() else False


def test_the_op_says_which_kernels_it_runs():
    kernels = cpu.describe()
    assert kernels.startswith("integer dot products" if INTEGER else "float kernels"), kernels


@pytest.mark.parametrize("method", PRODUCTION_METHODS)
def test_production_shapes_match_the_reference(method):
    """A left-padded batch, decode steps across a block boundary, a crop inside a block and
    reordered beams (``helpers.compare_production``), within the stated tolerance."""
    compare_production(method, "cpu", INTEGER_TOLERANCE)


@pytest.mark.parametrize("group", [1, 2, 3, 5, 6, 8])
@pytest.mark.parametrize("method", ["kivi2", "pnmix1", "chanmix"])
def test_every_query_group_matches_the_reference(method, group):
    """The op computes a KV head's query rows in tiles of at most four, each tile only its real
    rows (a group of 3 is one tile of 3; 5 is 4 + 1; 6 is 4 + 2): every tile size, in the
    integer path (the float kernels where the CPU lacks it), the float slots and the values,
    within the stated tolerance."""
    compare_production(method, "cpu", INTEGER_TOLERANCE, steps=6, heads=(2 * group, 2))
