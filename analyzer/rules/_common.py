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


def guessed(factor: float, of: str) -> str:
    """The sentence that says an estimate rests on an unmeasured factor (issue 44): no script in
    the repository has measured what applying this fix saves, so the finding says so."""
    return (f" Estimate: {100 * factor:.0f}% of {of} saved — a guessed factor, not yet checked against "
            "the speedup of applying the fix.")


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


# "/run/stacklens/": the injected agent's own code (its threads' stacks), never the user's
_LIBRARY = ("site-packages/", "dist-packages/", "/lib/python3", "<frozen ", "<string>", "/run/stacklens/")
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


UNNAMED_KERNEL = "unresolved:"


def is_unnamed_kernel(f: Frame) -> bool:
    """A launch of a kernel whose name BPF never read (`kernel:unresolved:0x<handle>`): a handle,
    not a name a user can act on; rules count these launches and never print the handle."""
    return f.kind == "kernel" and f.name.startswith(UNNAMED_KERNEL)


def names(view: View, nodes: Iterable[int], limit: int = 6) -> list[str]:
    """Distinct frame names of `nodes`, most frequent first (unnamed kernels left out)."""
    counts: dict[str, int] = {}
    for n in nodes:
        if is_unnamed_kernel(view.frames[n]):
            continue
        name = view.frames[n].name
        counts[name] = counts.get(name, 0) + 1
    return [k for k, _ in sorted(counts.items(), key=lambda kv: -kv[1])][:limit]


# A demangled function's return type before its name: `void `, and SFINAE-guarded templates
# (cuBLAS: `std::enable_if<!(false), void>::type internal::gemvx::kernel<…>(…)`), whose return type
# would otherwise be all a short label shows.
_ENABLE_IF = re.compile(r"^\s*(?:typename\s+)?std::enable_if<")
_NS = re.compile(r"\b(?:void |at::native::|at::|c10::|\(anonymous namespace\)::|binary_internal::|[A-Za-z_]+_internal::)")
_GENERIC = re.compile(r"^(?:vectorized_|unrolled_)?elementwise_kernel|^reduce_kernel|^vectorized_|^unrolled_")
_WHAT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:Functor[A-Za-z0-9_]*|_kernel_cuda|_kernel|Ops|Op))\b")


def kernel_label(name: str, width: int = 48) -> str:
    """A short, telling form of a demangled kernel name: namespaces dropped, and for PyTorch's
    generic elementwise/reduce kernels the functor that says what they compute
    (`vectorized_elementwise_kernel[MulFunctor]`)."""
    if name.startswith(UNNAMED_KERNEL):
        return "[kernel name not read]"
    name = _strip_return_type(name)
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


def _strip_return_type(name: str) -> str:
    """`std::enable_if<…>::type NAME<…>(…)` -> `NAME<…>(…)`: the template's brackets are skipped
    by depth, so `>` inside them does not end it."""
    m = _ENABLE_IF.match(name)
    if not m:
        return name
    depth, i = 1, m.end()
    while i < len(name) and depth:
        depth += {"<": 1, ">": -1}.get(name[i], 0)
        i += 1
    rest = name[i:]
    if rest.startswith("::type"):
        rest = rest[len("::type"):]
    return rest.strip() or name


def short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def short_file(file: str) -> str:
    """A source file as a user reads it: a library's path from its package (`transformers/…`)."""
    for marker in ("site-packages/", "dist-packages/"):
        k = file.rfind(marker)
        if k >= 0:
            return file[k + len(marker):]
    return file


def where(f: Frame) -> str:
    """`file:line function` of a Python frame."""
    return f"{short_file(f.file)}:{f.line} {f.name}"


def path_location(path: Iterable[str]) -> str | None:
    """Where a finding's path is, as a user can act on it: its innermost Python line and, when
    that line is in a library (a model from transformers, torch.nn), the innermost line of the
    user's own code that called it; None when the path holds no Python frame."""
    inner = user = None
    for label in path:
        if not label.startswith("py:"):
            continue
        try:
            f = Frame.from_label(label)
        except ValueError:
            continue
        inner = f
        if not is_library_file(f.file):
            user = f
    if inner is None:
        return None
    if user is None or user is inner:
        return where(inner)
    return f"{where(inner)}, called from {where(user)}"
