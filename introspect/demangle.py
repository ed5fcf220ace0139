"""C++ name demangling for kernel names (CUPTI reports mangled names; torch.profiler shows them
demangled). In-process through libstdc++'s ``__cxa_demangle`` (no subprocess per name), cached,
bounded; a name that does not demangle is shown as given."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

_CACHE: dict[str, str] = {}
_CACHE_MAX = 100_000
_LOCK = threading.Lock()
_LIB: tuple | None = None


def _lib() -> tuple | None:
    global _LIB
    if _LIB is None:
        try:
            cxx = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
            libc = ctypes.CDLL(None)
            fn = cxx.__cxa_demangle
            fn.restype = ctypes.c_void_p
            fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
            free = libc.free
            free.argtypes = [ctypes.c_void_p]
            _LIB = (fn, free)
        except (OSError, AttributeError):
            _LIB = ()
    return _LIB or None


def demangle(name: str) -> str:
    """The demangled form of an Itanium C++ name (`_Z…`), else the name unchanged."""
    if not name.startswith("_Z"):
        return name
    hit = _CACHE.get(name)
    if hit is not None:
        return hit
    out = name
    lib = _lib()
    if lib:
        fn, free = lib
        status = ctypes.c_int(0)
        with _LOCK:
            ptr = fn(name.encode("utf-8", "replace"), None, None, ctypes.byref(status))
            if ptr:
                try:
                    if status.value == 0:
                        out = ctypes.string_at(ptr).decode("utf-8", "replace")
                finally:
                    free(ptr)
    if len(_CACHE) < _CACHE_MAX:
        _CACHE[name] = out
    return out

