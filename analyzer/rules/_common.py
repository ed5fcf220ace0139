"""Helpers shared by the built-in rules: name patterns, per-line cost, evidence. Pure."""

from __future__ import annotations

import re
from collections.abc import Iterable

from stacklens.cct import Frame

from stacklens.analyzer.view import View, name_matcher, op_base

TIME_METRICS = ("cpu_samples", "py_samples", "gpu_time_ns", "api_cpu_ns", "sync_wait_ns")
ALL_METRICS = TIME_METRICS + ("kernel_count", "launch_count", "alloc_bytes", "copy_bytes")

is_launch_api = name_matcher(r"launch")  # cuLaunchKernel(Ex), cudaLaunchKernel, hipModuleLaunchKernel…
is_sync_api = name_matcher(r"synchroni[sz]e")  # cuStreamSynchronize, cuCtxSynchronize, cudaDeviceSynchronize…
is_memcpy_api = name_matcher(r"memcpy")
is_alloc_api = name_matcher(r"^(cu|cuda|hip)(Mem)?(Alloc|Malloc|Free|Create|Map|Unmap|AddressReserve|AddressFree|Release)")


def op_named(*bases: str, exact: Iterable[str] = ()):
    """Predicate over frames: an op whose name, without its namespace, is one of `bases` with
    any overload suffix (at::_ops naming: `zeros_names`, `empty_memory_format`), or exactly one
    of `exact` (for short names such as `to` whose prefix would catch unrelated ops)."""
    prefixes = tuple(b + "_" for b in bases)
    whole = frozenset(bases) | frozenset(exact)

    def pred(f: Frame) -> bool:
        if f.kind != "op":
            return False
        base = op_base(f.name)
        return base in whole or base.startswith(prefixes)

    return pred


def api(pred_name):
    return lambda f: f.kind == "gpu_api" and pred_name(f.name)


def kernel(pred_name):
    return lambda f: f.kind == "kernel" and pred_name(f.name)


def cost(view: View, acc: dict[str, int]) -> tuple[float, dict[str, float]]:
    """Share of the process's time a group of exclusive values stands for, and its evidence.

    The share is the largest of: CPU samples over all CPU samples, GPU time over the time base,
    API CPU + sync wait time over the time base. They overlap (a thread spinning in a sync is
    also sampled on CPU), so they are not added.
    """
    ev: dict[str, float] = {}
    shares = [0.0]
    cm = view.cpu_metric
    if cm and acc.get(cm):
        ev[cm] = acc[cm]
        ev["cpu_share"] = round(view.cpu_share(acc[cm]), 4)
        shares.append(ev["cpu_share"])
    if acc.get("gpu_time_ns"):
        ev["gpu_time_ns"] = acc["gpu_time_ns"]
        ev["gpu_share"] = round(view.gpu_share(acc["gpu_time_ns"]), 4)
        shares.append(ev["gpu_share"])
    host_ns = acc.get("api_cpu_ns", 0) + acc.get("sync_wait_ns", 0)
    for m in ("api_cpu_ns", "sync_wait_ns"):
        if acc.get(m):
            ev[m] = acc[m]
    if host_ns and view.wall_ns:
        ev["api_and_wait_share"] = round(view.ns_share(host_ns), 4)
        shares.append(ev["api_and_wait_share"])
    for m in ("kernel_count", "launch_count", "alloc_bytes", "copy_bytes"):
        if acc.get(m):
            ev[m] = acc[m]
    return max(shares), ev


def add_time_base(view: View, ev: dict[str, float]) -> None:
    if view.wall_ns:
        ev["wall_ns"] = round(view.wall_ns)


def line_path(view: View, line: int, fallback: int | Iterable[int]) -> tuple[str, ...]:
    """Labels down to the Python line. When the context has no Python frame (BPF stacks
    without Python), down to the fallback node: given several, an operator first (the most
    telling frame a user can search for), then the lowest id (the outermost)."""
    if line:
        return view.labels(line)
    if not isinstance(fallback, int):
        frames = view.frames
        fallback = min(fallback, key=lambda n: (frames[n].kind != "op", n))
    return view.labels(fallback)


_LIBRARY = ("site-packages/", "dist-packages/", "/lib/python3", "<frozen ", "<string>")
_LIBRARY_PKGS = ("torch/", "jax/", "jaxlib/", "numpy/", "triton/", "transformers/")


def is_library_file(file: str) -> bool:
    return any(s in file for s in _LIBRARY) or file.startswith(_LIBRARY_PKGS)


def user_line(view: View, line: int) -> str | None:
    """`file:func:line` of the deepest Python frame outside libraries at or above `line`, when
    that is not `line` itself: where in the user's code a library line was called from."""
    node = line
    while node:
        f = view.frames[node]
        if f.kind == "python" and not is_library_file(f.file):
            return None if node == line else f"{f.file}:{f.name}:{f.line}"
        node = view.parents[node]
    return None


def names(view: View, nodes: Iterable[int], limit: int = 6) -> list[str]:
    """Distinct frame names of `nodes`, most frequent first."""
    counts: dict[str, int] = {}
    for n in nodes:
        name = view.frames[n].name
        counts[name] = counts.get(name, 0) + 1
    return [k for k, _ in sorted(counts.items(), key=lambda kv: -kv[1])][:limit]


_NS = re.compile(r"\b(?:void |at::native::|at::|c10::|\(anonymous namespace\)::|binary_internal::|[A-Za-z_]+_internal::)")
_GENERIC = re.compile(r"^(?:vectorized_|unrolled_)?elementwise_kernel|^reduce_kernel|^vectorized_|^unrolled_")
_WHAT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:Functor[A-Za-z0-9_]*|_kernel_cuda|_kernel|Ops|Op))\b")


def kernel_label(name: str, width: int = 48) -> str:
    """A short, telling form of a demangled kernel name: namespaces dropped, and for PyTorch's
    generic elementwise/reduce kernels the functor that says what they compute
    (`vectorized_elementwise_kernel[MulFunctor]`)."""
    text = _NS.sub("", name)
    head = re.split(r"[<(]", text, maxsplit=1)[0].strip()
    if re.search(r"(?:^|::)Kernel\d*$", head):  # cutlass::Kernel2<cutlass_80_simt_sgemm_…>
        inner = re.match(r"\s*<\s*([A-Za-z_][A-Za-z0-9_]*)", text[len(head):])
        if inner:
            return short(inner.group(1), width)
    if _GENERIC.search(head):
        for m in _WHAT.finditer(text[len(head):]):
            what = m.group(1)
            if what not in ("BinaryFunctor", "ReduceOp", "gpu_kernel_impl_nocast", "gpu_kernel_impl") and not _GENERIC.search(what):
                return short(f"{head}[{what}]", width)
    return short(head or text, width)


def short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"
