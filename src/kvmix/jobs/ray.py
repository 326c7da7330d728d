"""Ray for kvmix's jobs and replicas: installed or a message naming the extra, and a cluster's
address checked at once (Ray itself waits a minute before it gives up)."""

from __future__ import annotations

import socket
from typing import Any

RAY_EXTRA = "pip install 'kvmix[ray]'  (ray[serve]==2.60.*)"


def reachable(address: str | None, timeout: float = 3.0) -> None:
    """A ``host:port`` (or ``ray://host:port``) address answers, or a ValueError at once
    (Ray itself waits a minute before it gives up)."""
    if address in (None, "auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address={address!r} is invalid; expected 'auto', host:port or "
                         "ray://host:port")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as error:
        raise ValueError(f"address={address!r}: no Ray cluster answers there ({error})") \
            from None


def require_ray(serve: bool = False) -> Any:
    """Ray (and Ray Serve, with ``serve``) is installed -> the ``ray`` module, or a ValueError
    with the line that installs it."""
    import importlib.util

    parts = ("ray", "ray.serve") if serve else ("ray",)
    if any(importlib.util.find_spec(part) is None for part in parts):  # "ray" checked first
        needed = "Ray Serve" if serve else "Ray"
        raise ValueError(f"--ray needs {needed}, which is not installed: {RAY_EXTRA}")
    import ray

    return ray
