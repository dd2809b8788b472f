"""Native CPU kernels, compiled from C on first use and called through ctypes.

What torch cannot express without copying (attention that reads the paged KV cache in
place) lives in `csrc/*.c`: plain C with OpenMP loops, no torch headers, so it builds in
about a second with the system's C compiler. The library is cached per source and CPU
(`cache_dir/native/<hash>/`); where no compiler is found or the build fails, `load()`
returns None and callers keep the torch path.

OpenMP: the library links `libgomp.so.1`, the soname of the runtime torch has already
loaded, so its loops share torch's thread pool and settings (thread count, wait policy).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import shutil
import subprocess
import tempfile
import threading
from functools import cache
from pathlib import Path
from typing import ClassVar, Self

import torch

from spillway.kernels.cpu.info import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
DEFAULT_CACHE_DIR = Path("~/.cache/spillway")
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def compile_flags() -> list[str]:
    """-O3 with OpenMP, plus AVX2/FMA where this CPU has them (the library is cached per
    CPU flags, so a machine without them never loads one built with them).

    -fno-trapping-math: nothing reads the floating-point exception flags, and with them
    kept GCC would not vectorize a loop whose select guards an operation that may raise
    one (fast_exp.h's clamp before its rounding: every softmax, SiLU and decay loop ran
    scalar, SiLU at 5x torch's time). It changes no value: no reassociation, no
    contraction (those stay as each kernel sets them)."""
    flags = [
        "-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC",
        "-std=gnu11",
    ]  # fmt: skip
    have = cpu_flags()
    if {"avx2", "fma"} <= have:
        flags += ["-mavx2", "-mfma"]
    if "f16c" in have:
        flags.append("-mf16c")
    return flags


# The vector paths of the kernels built per instruction set (`argmax`, `noise`,
# `experts_native`), best first, and the CPU flags each needs.
ISAS: dict[str, frozenset[str]] = {
    "avx512": frozenset({"avx512f"}),
    "avx2": frozenset({"avx2", "fma"}),
    "portable": frozenset(),
}


def best_isa() -> str:
    """The best of ISAS this CPU runs."""
    have = cpu_flags()
    return next(name for name, needs in ISAS.items() if needs <= have)


def isa_flags(isa: str) -> list[str]:
    """compile_flags() (AVX2 dropped for the portable build) and the vector extension `isa`
    names."""
    flags = [f for f in compile_flags() if f not in ("-mavx2", "-mfma", "-mf16c")]
    if isa == "avx512":
        return [*flags, "-mavx2", "-mfma", "-mavx512f"]
    if isa == "avx2":
        return [*flags, "-mavx2", "-mfma"]
    return flags


class IsaLibrary:
    """A library built for one of the vector paths of ISAS (`argmax`, `noise`,
    `experts_native`): its `source`, named `what` in errors."""

    source: ClassVar[Path]
    what: ClassVar[str]

    def __init__(self, library: ctypes.CDLL, isa: str) -> None:
        self.isa = isa

    @classmethod
    def load(cls, cache_dir: str | Path = DEFAULT_CACHE_DIR, isa: str | None = None) -> Self | None:
        """The library built for `isa` (by default the best this CPU runs) on first use;
        None where it cannot be built here. A path this CPU cannot run is refused."""
        isa = isa or best_isa()
        if not ISAS[isa] <= cpu_flags():
            raise ValueError(f"this CPU cannot run the {isa} {cls.what}")
        library = build(cls.source, isa_flags(isa), cache_dir)
        return None if library is None else cls(library, isa)


def bind(fn: ctypes._CFuncPtr, restype: type | None, argtypes: list) -> ctypes._CFuncPtr:
    """A library's function with its C signature declared (ctypes converts the arguments by
    it and would otherwise take the result for an int)."""
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a C argument that may be NULL."""
    return None if t is None else t.data_ptr()


@cache
def compiler_accepts(*flags: str) -> bool:
    """Whether this machine's C compiler takes these flags (e.g. -mamx-int8, which older
    compilers do not know)."""
    compiler = _compiler()
    if compiler is None:
        return False
    try:
        done = subprocess.run(
            [compiler, *flags, "-E", "-x", "c", "-", "-o", "/dev/null"],
            input="",
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def attention_flags() -> list[str]:
    """compile_flags() and AVX-512 where this CPU has it: the attention's 16-wide score and
    value loops (the portable loops serve a build without it)."""
    flags = compile_flags()
    if {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags():
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl"]
    return flags


# The cache dtypes the native attention reads (float32 arithmetic on either).
CACHE_DTYPES = (torch.float32, torch.bfloat16)
_ATTENTION_ARGS = [
    _PTR, _I64, _I64,  # q, its token and head strides
    _PTR, _PTR,  # k_cache, v_cache
    _PTR, _I64, _PTR,  # block_tables, its row stride, context_lens
    _PTR, _PTR,  # query_start, out
    _I64, _I64, _I64, _I64, _I64,  # rows, q heads, kv heads, head dim, block size
    _F32,  # scale
]  # fmt: skip


class NativeKernels:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        self._paged_attention = {
            torch.float32: bind(library.paged_attention_f32, ctypes.c_int, _ATTENTION_ARGS),
            torch.bfloat16: bind(library.paged_attention_bf16, ctypes.c_int, _ATTENTION_ARGS),
        }
        self._use_pool = bind(library.paged_attention_use_pool, None, [_PTR])

    def use_pool(self, run_address: int | None) -> None:
        """Many-row calls on the process's shared helper threads (`pool.Pool.run_address`),
        or on OpenMP's (None). Set for the library, which every instance of this build
        shares; the outputs are the same either way."""
        self._use_pool(run_address)

    def addresses(self) -> dict[str, int | None]:
        """The kernels' entry points, for native callers (`decode_layers`)."""
        return {
            "attention": address_of(self._paged_attention[torch.float32]),
            "attention_bf16": address_of(self._paged_attention[torch.bfloat16]),
        }

    def paged_attention(
        self,
        q: torch.Tensor,  # [T, Hq, D] float32, unit stride in D
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D] float32 or bfloat16, contiguous
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [R, MB] int32, unit stride in MB
        context_lens: torch.Tensor,  # [R] int32, contiguous
        query_start: torch.Tensor,  # [R + 1] int64, contiguous
        scale: float,
        out: torch.Tensor,  # [T, Hq, D] float32, contiguous
    ) -> torch.Tensor:
        """Attention of every query over its row's cached context, read in place."""
        _, q_heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        assert q.dtype == out.dtype == torch.float32
        assert k_cache.dtype == v_cache.dtype and k_cache.dtype in CACHE_DTYPES
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()
        assert q.stride(2) == 1 and block_tables.stride(1) == 1
        assert block_tables.dtype == context_lens.dtype == torch.int32
        assert query_start.dtype == torch.int64 and context_lens.is_contiguous()
        assert query_start.is_contiguous() and q_heads % kv_heads == 0
        rows = block_tables.shape[0]
        code = self._paged_attention[k_cache.dtype](
            q.data_ptr(), q.stride(0), q.stride(1),
            k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
            query_start.data_ptr(), out.data_ptr(),
            rows, q_heads, kv_heads, head_dim, block_size,
            scale,
        )  # fmt: skip
        if code != 0:
            raise MemoryError("native paged attention could not allocate its buffers")
        return out


def address_of(fn: ctypes._CFuncPtr) -> int | None:
    """A loaded C function's address, to hand to other native code."""
    return ctypes.cast(fn, ctypes.c_void_p).value


_loaded: dict[Path, ctypes.CDLL | None] = {}
_lock = threading.Lock()


def load(cache_dir: str | Path = DEFAULT_CACHE_DIR) -> NativeKernels | None:
    """The native kernels, built on first use; None where they cannot be built here."""
    library = build(SOURCE, attention_flags(), cache_dir)
    return None if library is None else NativeKernels(library)


def build(source: Path, flags: list[str], cache_dir: str | Path) -> ctypes.CDLL | None:
    """`source` built with `flags` into a shared library (once per source, flags and cache
    folder, kept across processes) and loaded; None where it cannot be built here."""
    folder = Path(cache_dir).expanduser() / "native" / build_key(source, flags)
    with _lock:
        if folder not in _loaded:
            _loaded[folder] = _build_and_load(folder, source, flags)
        return _loaded[folder]


def build_key(source: Path, flags: list[str]) -> str:
    # The headers beside the source are part of it (a source may include any of them).
    h = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        h.update(header.read_bytes())
    h.update(" ".join(flags).encode())
    return h.hexdigest()[:16]


def _build_and_load(folder: Path, source: Path, flags: list[str]) -> ctypes.CDLL | None:
    library = folder / "libspillway_native.so"  # the folder names the source and flags
    try:
        if not library.is_file():
            compiler = _compiler()
            if compiler is None:
                log.info("no C compiler: native CPU kernels (%s) unavailable", source.name)
                return None
            folder.mkdir(parents=True, exist_ok=True)
            # Built beside and renamed into place: a concurrent loader never sees half a file.
            with tempfile.NamedTemporaryFile(dir=folder, suffix=".so", delete=False) as tmp:
                partial = Path(tmp.name)
            try:
                subprocess.run(
                    [compiler, *flags, str(source), "-o", str(partial), "-lm"],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                partial.replace(library)
            finally:
                partial.unlink(missing_ok=True)
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("native CPU kernels (%s) unavailable (%s)", source.name, detail.strip())
        return None
