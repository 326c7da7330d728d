"""One build of the llama.cpp that the ``engine`` extra's llama-cpp-python vendors, correct on
any x86 CPU, and its Python bindings.

The build (``make engine``; ``python -m kvmix.engines.llamacpp.build``) takes llama-cpp-python's
source release from the package index, configures its ``vendor/llama.cpp`` with runtime CPU
dispatch (``GGML_BACKEND_DL`` + ``GGML_CPU_ALL_VARIANTS``: one ``libggml-cpu-<variant>.so`` per
x86 level, the best one the CPU supports loaded at start, no ISA flag guessed) and builds
``llama-server`` with the shared libraries into ``$KVMIX_CACHE/llama.cpp/<version>/build/bin``.
The Python bindings load the same libraries (``LLAMA_CPP_LIB_PATH``), so ``llama-server`` and
``kvmix bench``'s batch-1 rows run one build.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from kvmix.core.paths import cache_root

VERSION = "0.3.36"  # llama-cpp-python, as the engine extra pins it
INSTALL = (f"pip install 'llama-cpp-python=={VERSION}' (or make engine, which also builds "
           "llama-server)")
BUILD_HINT = "make engine (python -m kvmix.engines.llamacpp.build)"
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF",
               "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON", "-DLLAMA_BUILD_SERVER=ON",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF"]


class EngineMissing(RuntimeError):
    """llama.cpp is not installed or not built here; the message says what to run."""


def root() -> Path:
    return cache_root() / "llama.cpp" / VERSION


def bin_dir() -> Path:
    return root() / "build" / "bin"


def server_binary() -> Path:
    """The built ``llama-server``; EngineMissing naming the build command when absent."""
    binary = bin_dir() / "llama-server"
    if not binary.is_file():
        raise EngineMissing(f"llama-server is not built (looked for {binary}); run {BUILD_HINT}")
    return binary


@functools.cache
def server_version() -> str:
    """``llama-server --version``: the llama.cpp build number, commit and compiler."""
    answer = subprocess.run([str(server_binary()), "--version"], capture_output=True,
                            text=True, timeout=60)
    return " ".join((answer.stdout + answer.stderr).split())


def build(jobs: int | None = None) -> Path:
    """Download llama-cpp-python's source release, configure its vendored llama.cpp with
    runtime CPU dispatch and build ``llama-server`` (about 25 minutes on 2 cores, once)."""
    source = _vendored_source()
    build_dir = root() / "build"
    log = root() / "build.log"
    with log.open("w") as out:
        for command in (["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_FLAGS],
                        ["cmake", "--build", str(build_dir), "--target", "llama-server",
                         "--parallel", str(jobs or os.cpu_count() or 1)]):
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode:
                raise EngineMissing(f"llama.cpp build failed: {' '.join(command[:2])}; "
                                    f"its output is in {log}")
    return server_binary()


def _vendored_source() -> Path:
    """``vendor/llama.cpp`` of llama-cpp-python's source release, downloaded once."""
    source = root() / "src" / f"llama_cpp_python-{VERSION}"
    if not (source / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        (root() / "src").mkdir(parents=True, exist_ok=True)
        download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d",
                    str(root() / "src")]
        if subprocess.run(download).returncode:
            raise EngineMissing(f"could not download llama-cpp-python=={VERSION}'s source "
                                "release from the package index")
        with tarfile.open(root() / "src" / f"llama_cpp_python-{VERSION}.tar.gz") as archive:
            archive.extractall(root() / "src", filter="data")
    return source / "vendor" / "llama.cpp"


@functools.cache
def bindings() -> Any:
    """``llama_cpp`` (the engine extra), on this build's libraries when it is built (every CPU
    variant registered from ``bin_dir()``), else on the libraries it was installed with."""
    if (bin_dir() / "libllama.so").is_file():
        os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(bin_dir()))
    try:
        import llama_cpp
    except ImportError as error:
        raise EngineMissing(f"llama.cpp's Python bindings are not installed ({error}); run "
                            f"{INSTALL}") from error
    if Path(os.environ.get("LLAMA_CPP_LIB_PATH", "")) == bin_dir():
        ggml = ctypes.CDLL(str(bin_dir() / "libggml.so"), mode=ctypes.RTLD_GLOBAL)
        ggml.ggml_backend_load_all_from_path(str(bin_dir()).encode())
    return llama_cpp


if __name__ == "__main__":
    print(build())
