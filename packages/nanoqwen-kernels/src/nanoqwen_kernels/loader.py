"""NVRTC loader: CUDA sources (package data under cuda/) -> cubin for an explicit arch -> loaded module.

Compiling needs no GPU: NVRTC is called directly through `cupy_backends.cuda.libs.nvrtc`, which never
asks the driver for a device, so CI compiles every kernel for sm_90a on a CPU machine. Model dims arrive
as -D constants (dims.ModelDims.defines), so each model size gets its own specialised cubin.

Cache: $NANOQWEN_KERNEL_CACHE (default ~/.cache/nanoqwen/kernels)/<sha256>.cubin, the key hashing the
sources and every header in cuda/, the options (defines included), the NVRTC version and the arch; a
cubin is written to a temporary file and renamed into place (os.replace), so concurrent processes never
read a half-written one. NANOQWEN_JIT_DEBUG=1 adds -lineinfo and prints each compile's time.

NVRTC quirk: cupy's `getCUBIN` wrapper returns one byte short (it treats the size as a C string length),
so the cubin is fetched through ctypes from the same libnvrtc that cupy loaded; failing that, the ELF
header says how long the image is and the missing tail is restored from it (see _get_cubin).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

from .errors import KernelError

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
DEFAULT_ARCH = "sm_90a"


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as e:
        raise KernelError(f"NVRTC unavailable (install nanoqwen-kernels[cuda12] or [cuda13]): {e}") from None
    return nvrtc


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


def _debug() -> bool:
    return os.environ.get("NANOQWEN_JIT_DEBUG", "") not in ("", "0")


def cache_dir() -> Path:
    env = os.environ.get("NANOQWEN_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "nanoqwen" / "kernels"


# A -D constant: an int, a float, or a tuple of floats (an initializer list: a table the kernels index)
Define = int | float | tuple[float, ...]


def _format_define(name: str, value: Define) -> str:
    if not name.isidentifier():
        raise KernelError(f"define name {name!r} is not a C identifier")
    if isinstance(value, tuple) and value and all(isinstance(v, float) for v in value):
        return f"-D{name}=" + ",".join(f"{v!r}f" for v in value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KernelError(f"define {name} must be an int, a float or a tuple of floats, got {value!r}")
    if isinstance(value, float):
        # repr round-trips exactly; the f suffix keeps the constant a float, not a double
        return f"-D{name}={value!r}f"
    return f"-D{name}={value}"


def _read_sources(sources: list[str]) -> list[tuple[str, str]]:
    if not sources:
        raise KernelError("compile_cubin needs at least one source file")
    out = []
    for name in sources:
        p = CUDA_DIR / name
        if not p.is_file():
            raise KernelError(f"no kernel source {name!r} under {CUDA_DIR}")
        out.append((name, p.read_text()))
    return out


def _cache_key(srcs: list[tuple[str, str]], options: list[str], arch: str) -> str:
    h = hashlib.sha256()
    for name, text in srcs:
        h.update(f"src {name}\0".encode())
        h.update(text.encode())
    # every header, not only those included: cheap, and no include scanner to get wrong
    for p in sorted(CUDA_DIR.glob("*.cuh")):
        h.update(f"hdr {p.name}\0".encode())
        h.update(p.read_bytes())
    h.update(("\0".join(options)).encode())
    h.update(f"nvrtc {nvrtc_version()} arch {arch}".encode())
    return h.hexdigest()


def _elf_size(image: bytes) -> int:
    """Extent of an ELF64 image from its header: the end of the program/section header tables."""
    if image[:4] != b"\x7fELF" or len(image) < 0x40:
        return len(image)
    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    return max(len(image), phoff + phentsize * phnum, shoff + shentsize * shnum)


@functools.cache
def _libnvrtc() -> ctypes.CDLL | None:
    # the libnvrtc cupy already loaded (a wheel's or the toolkit's), found in our own memory map
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "libnvrtc" in ln and "builtins" not in ln}
        for p in sorted(paths):
            lib = ctypes.CDLL(p)
            if hasattr(lib, "nvrtcGetCUBINSize"):
                return lib
    except OSError:
        pass
    return None


def _get_cubin(prog: int) -> bytes:
    lib = _libnvrtc()
    if lib is not None:
        size = ctypes.c_size_t()
        if lib.nvrtcGetCUBINSize(ctypes.c_void_p(prog), ctypes.byref(size)) == 0:
            buf = ctypes.create_string_buffer(size.value)
            if lib.nvrtcGetCUBIN(ctypes.c_void_p(prog), buf) == 0:
                return buf.raw
    image = _nvrtc().getCUBIN(prog)
    want = _elf_size(image)
    # the dropped tail is the last byte(s) of the last header table entry: zero in every cubin
    # we have inspected (NVRTC 12.9, 13.0); ctypes above is the exact path, this the fallback
    return image + b"\0" * (want - len(image))


def extra_defines() -> dict[str, int]:
    """$NANOQWEN_KERNEL_DEFINES ("NAME=INT,NAME=INT"): tuning knobs added to every build, for A/B runs
    (e.g. NQ_TILE_PRODUCERS=2, NQ_GEMV_STAGE_PIECES=2). They enter the options, hence the cache key."""
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in os.environ.get("NANOQWEN_KERNEL_DEFINES", "").split(","))):
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = int(value)
        except ValueError:
            raise KernelError(f"NANOQWEN_KERNEL_DEFINES: {item!r} is not NAME=INT") from None
        if not sep:
            raise KernelError(f"NANOQWEN_KERNEL_DEFINES: {item!r} is not NAME=INT")
    return out


def build_options(defines: dict[str, Define], arch: str) -> list[str]:
    opts = ["-std=c++17", f"--gpu-architecture={arch}", "--extra-device-vectorization"]
    if _debug():
        opts.append("-lineinfo")
    opts += [_format_define(k, v) for k, v in sorted({**defines, **extra_defines()}.items())]
    return opts


def compile_cubin(sources: list[str], defines: dict[str, Define], arch: str = DEFAULT_ARCH) -> bytes:
    """Compile (or fetch from the disk cache) the cubin of `sources` (file names under cuda/)."""
    srcs = _read_sources(list(sources))
    options = build_options(dict(defines), arch)
    key = _cache_key(srcs, options, arch)
    path = cache_dir() / f"{key}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass

    nvrtc = _nvrtc()
    # one translation unit that includes each source, so several .cu files make one module
    main = "".join(f'#include "{name}"\n' for name, _ in srcs)
    t0 = time.perf_counter()
    prog = nvrtc.createProgram(main, "nanoqwen_module.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*options, f"-I{CUDA_DIR}"])
        except nvrtc.NVRTCError as e:
            try:
                log = nvrtc.getProgramLog(prog)
            except Exception:
                log = "(no log)"
            raise KernelError(
                f"NVRTC {nvrtc_version()} failed to compile {', '.join(sources)} for {arch}: {e}\n{log}"
            ) from None
        cubin = _get_cubin(prog)
    finally:
        nvrtc.destroyProgram(prog)
    if _debug():
        print(
            f"[nanoqwen jit] {'+'.join(sources)} {arch}: {time.perf_counter() - t0:.2f} s, {len(cubin)} B",
            file=sys.stderr,
        )

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:  # a read-only home is no reason to fail: the cubin is still good
        if _debug():
            print(f"[nanoqwen jit] cache write failed: {e}", file=sys.stderr)
    return cubin


def device_arch() -> str:
    """The current CuPy device's arch: sm_90a on Hopper (the 'a' unlocks wgmma/setmaxnreg), else sm_XY."""
    import cupy

    cc = cupy.cuda.Device().compute_capability
    return f"sm_{cc}a" if cc == "90" else f"sm_{cc}"


_LOADED: list[LoadedModule] = []  # every module this process loaded (stamps.py points their stamp buffers)


def loaded_modules() -> list[LoadedModule]:
    """The modules loaded in this process so far, oldest first."""
    return list(_LOADED)


class LoadedModule:
    """A cubin loaded on the current device; get_function(name) for extern "C" kernels."""

    def __init__(self, cubin: bytes, sources: tuple[str, ...]):
        import cupy

        self.sources = sources
        self._module = cupy.cuda.function.Module()
        self._module.load(cubin)
        self._functions: dict[str, object] = {}
        _LOADED.append(self)

    def global_address(self, name: str) -> int | None:
        """The device address of the module-scope variable `name` (C linkage), or None where it has none."""
        try:
            p = self._module.get_global_var(name)
        except Exception:
            return None
        p = p[0] if isinstance(p, tuple) else p
        return int(getattr(p, "ptr", p))

    def get_function(self, name: str, max_dynamic_smem: int = 0):
        fn = self._functions.get(name)
        if fn is None:
            try:
                fn = self._module.get_function(name)
            except Exception as e:
                raise KernelError(f"kernel {name!r} not found in {'+'.join(self.sources)}: {e}") from None
            self._functions[name] = fn
        if max_dynamic_smem > 48 * 1024:
            from cupy_backends.cuda.api import driver

            # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
            driver.funcSetAttribute(fn.ptr, 8, max_dynamic_smem)
        return fn


@functools.cache
def _load_cached(sources: tuple[str, ...], defines: tuple, arch: str, device: int) -> LoadedModule:
    return LoadedModule(compile_cubin(list(sources), dict(defines), arch), sources)


def load_module(sources: list[str], defines: dict[str, Define], arch: str | None = None) -> LoadedModule:
    """Compile (cached) and load `sources` on the current CuPy device; arch defaults to the device's."""
    import cupy

    arch = arch or device_arch()
    dev = cupy.cuda.Device().id
    return _load_cached(*module_key(sources, defines), arch, dev)


def module_key(sources: list[str], defines: dict[str, Define]) -> tuple[tuple, tuple]:
    """What load_module caches a loaded module under: the sources and every define compiled into it,
    $NANOQWEN_KERNEL_DEFINES' too (build_options adds them), so a launcher built under other defines in the same
    process (a test's variant build) gets its own module, not the first one loaded from the same sources."""
    return tuple(sources), tuple(sorted({**defines, **extra_defines()}.items()))
