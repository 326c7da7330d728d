"""The README's quick start, as a newcomer copies it: its Python block runs in a process of its
own on the default model and prints what it promises."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
pytestmark = [pytest.mark.integration, pytest.mark.process]


def _quick_start() -> str:
    section = README.read_text().split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_quick_start_runs_as_written():
    code = _quick_start()
    assert len(code.strip().splitlines()) <= 10
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    nbytes = int(lines[-1].split()[0])  # print(cache.nbytes(), ...)
    assert nbytes > 0 and len(lines) >= 2
