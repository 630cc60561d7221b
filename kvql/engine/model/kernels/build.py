"""The build of kvql's C kernels (`kvql/engine/model/kernels/*.c`): once per machine with the system C compiler,
loaded with ctypes.

`load(name, flags)` compiles `<name>.c` (with the headers beside it) into `$KVQL_CACHE_DIR/kernels`
(default `~/.cache/kvql/kernels`, `$XDG_CACHE_HOME` honoured), keyed by the sources, the compiler, the flags and the CPU's feature flags
(a library is built for the native instruction set), and loads it. Builds are atomic (`os.replace`), so
concurrent processes each install a whole library. Each build records the library's size and SHA-256
beside it; a library that no longer matches (truncated, overwritten) is built again, with a warning,
instead of being loaded. Raises when there is no compiler or the build fails:
callers fall back to torch ops then. OpenMP: the libraries share torch's runtime (the same
`libgomp.so.1`). `$KVQL_KERNEL_FLAGS` (split on spaces) is appended to every build's flags: `-mno-avx512f` builds
every kernel as an AVX2 machine has it (what the benchmarks use to measure an AVX2 CPU on an AVX-512 one).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).parent
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The dtypes kvql's kernels take, as their `is_bf16` argument."""
BASE_FLAGS = ["-O2", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def cache_dir() -> Path:
    """Where built libraries go: kvql's cache directory (as the model loader's), `kernels/` in it."""
    root = os.environ.get("KVQL_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvql"
    return Path(root) / "kernels"


def load(name: str, flags: list[str] | None = None) -> ctypes.CDLL:
    """The library built from `<name>.c` with BASE_FLAGS plus `flags` (module doc)."""
    cc = os.environ.get("CC", "cc")
    flags = BASE_FLAGS + list(flags or []) + os.environ.get("KVQL_KERNEL_FLAGS", "").split()
    source = HERE / f"{name}.c"
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(HERE.glob("*.h")))
    key = hashlib.sha256(text + " ".join([cc, *flags, cpu_flags()]).encode()).hexdigest()[:16]
    cache = cache_dir()
    path = cache / f"{name}-{key}.so"
    stamp = path.with_suffix(".sha256")
    if path.exists() and not _intact(path, stamp):
        # a truncated library would be mapped and crash the process (SIGBUS) at its first call; one without
        # a record is an older kvql's build: built again without a word
        if stamp.exists():
            warnings.warn(f"kvql: the cached kernel library {path} is damaged (its size or checksum is not its "
                          "build's); building it again")
        path.unlink(missing_ok=True)
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
            record = _record(Path(tmp))
            os.replace(tmp, path)
            fd, tmp_stamp = tempfile.mkstemp(suffix=".sha256", dir=cache)
            with open(fd, "w") as f:
                f.write(record)
            os.replace(tmp_stamp, stamp)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(path))


def _record(path: Path) -> str:
    """A library's size and SHA-256, as its build wrote it (`<name>.sha256` beside it)."""
    data = path.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def _intact(path: Path, stamp: Path) -> bool:
    try:
        return stamp.read_text() == _record(path)
    except OSError:
        return False


I64, F32, I32, PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p  # for signature tables


class Library:
    """A kernel library built on first use (`load`), or the reason it cannot be: `available()` is False when
    there is no compiler, the build fails (warned about once: `what` says what runs instead), or the
    environment variable `switch` is "0". `signatures`: C function name -> (result type or None, [argument
    types]), the one place each is declared; `limits`: names of `const int` the library exports (its
    compile-time limits), read into `self.limits` once it is loaded. Thread-safe."""

    def __init__(self, name: str, switch: str, what: str, signatures: dict, flags: list[str] | None = None,
                 limits: tuple[str, ...] = ()):
        self.name, self.switch, self.what, self.flags = name, switch, what, flags
        self.signatures, self.limit_names = signatures, limits
        self.limits: dict[str, int] = {}
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self._lock = threading.Lock()

    def available(self) -> bool:
        if os.environ.get(self.switch, "1") == "0":
            return False
        with self._lock:
            if self.lib is None and self.error is None:
                try:
                    lib = load(self.name, self.flags)
                    for fn, (result, args) in self.signatures.items():
                        getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, result
                    self.limits = {n: ctypes.c_int.in_dll(lib, n).value for n in self.limit_names}
                    self.lib = lib
                except Exception as e:  # no compiler, no OpenMP, a read-only cache
                    self.error = f"{type(e).__name__}: {e}"
                    warnings.warn(f"kvql: {self.name} kernels unavailable, {self.what} ({self.error})")
        return self.lib is not None

    def get(self) -> ctypes.CDLL:
        """The loaded library; once built, the switch no longer matters to a running model."""
        if self.lib is None and not self.available():
            raise RuntimeError(f"{self.name} kernels unavailable: {self.error or self.switch + '=0'}")
        return self.lib
