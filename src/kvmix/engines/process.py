"""An engine's server as a local process: started on a free port of 127.0.0.1, ready once its
``/health`` answers, stopped when its block ends (llama.cpp's and vLLM's servers build on it)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

import httpx


class ServerDown(RuntimeError):
    """A local server exited or did not answer /health in time; the message says which."""


def log_tail(log: Path | None, lines: int = 3) -> str:
    """The last lines of a server's log, joined (what a row shows when it did not come up)."""
    text = log.read_text(errors="replace").strip().splitlines() if log and log.is_file() else []
    return " | ".join(line[-300:] for line in text[-lines:])


class LocalServer:
    """A server subprocess on a free port of 127.0.0.1 (``command(port)``), output to ``log``
    when given: entering starts it and waits until ``/health`` answers 200 -> its URL
    (``ServerDown`` when it exits first or takes over ``timeout`` seconds), the seconds that
    took in ``startup_s``; the block's end stops it."""

    timeout = 300.0
    env: dict[str, str] | None = None

    def __init__(self, log: Path | None = None):
        self.log = log
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def command(self, port: int) -> list[str]:
        raise NotImplementedError

    def __enter__(self) -> str:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        output = None
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            output = self.log.open("w")
        with output or contextlib.nullcontext():
            self.process = subprocess.Popen(self.command(port), stdout=output,
                                            stderr=subprocess.STDOUT if output else None,
                                            env=self.env)
        url = f"http://127.0.0.1:{port}"
        start = time.monotonic()
        while time.monotonic() < start + self.timeout and self.process.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - start
                    return url
            time.sleep(0.2)
        code = self.process.poll()
        self.__exit__()
        raise ServerDown(f"exit code {code}" if code is not None
                         else f"no /health in {self.timeout:g} s")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
