"""Puts OpenBLAS under MLX's CPU backend on Linux, before the first `import mlx.core`."""

from __future__ import annotations

import ctypes
import os
import platform
import re
import sys
from pathlib import Path

_in_use: str | None = None

# How long OpenBLAS's threads spin for work after a call, as a power of two of cycles: 2^16,
# ~25 us. Its default, 2^28 (~0.1 s), keeps a core busy after every sgemm while mlxgate's own
# kernels (norms, rope, attention) need both: the embedded model's 4,096-token prefill took
# 17.5 s with it and 12.7 s with this (the issue 50 note). A value in the environment wins.
THREAD_TIMEOUT = "16"


def _openblas_path() -> Path | None:
    # cmeel-openblas installs into <site-packages>/cmeel.prefix/lib.
    for entry in sys.path:
        lib = Path(entry) / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        if lib.exists():
            return lib
    return None


def _cpu_lacks_avx2() -> bool:
    # cmeel-openblas 0.3.29 is built for Zen (AVX2 + FMA) without runtime dispatch; on an older
    # x86 CPU it would die with SIGILL instead of falling back.
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return not re.search(r"^flags\s*:.*\bavx2\b", flags, re.MULTILINE)


def preload_openblas() -> str:
    """Load OpenBLAS with RTLD_GLOBAL so mlx's BLAS calls bind to it; return which BLAS is in use.

    The `mlx-cpu` wheel for Linux bundles the reference BLAS, about 30x slower than OpenBLAS on
    the matmuls that dominate a forward pass. Symbols already in the global namespace win, so
    this must run before mlx.core is imported. macOS uses Accelerate and needs nothing.
    """
    global _in_use
    if _in_use is not None:
        return _in_use
    if sys.platform == "darwin":
        _in_use = "Accelerate"
    elif "mlx.core" in sys.modules:
        _in_use = "reference BLAS (mlx.core was imported before OpenBLAS could be preloaded)"
    elif _cpu_lacks_avx2():
        _in_use = (
            "reference BLAS, ~30x slower (this CPU lacks AVX2, which the OpenBLAS build needs)"
        )
    elif (path := _openblas_path()) is None:
        _in_use = "reference BLAS, ~30x slower (install cmeel-openblas)"
    else:
        os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)  # read when it loads
        try:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            _in_use = "OpenBLAS"
        except OSError as exc:  # typically libgfortran5 missing: `make system-deps`
            _in_use = f"reference BLAS, ~30x slower (OpenBLAS failed to load: {exc})"
    return _in_use


def blas_in_use() -> str:
    return _in_use or "not loaded yet"
