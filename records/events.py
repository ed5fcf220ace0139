"""BPF events as the join takes them: decoded ring records (immutable tuples), what
ProbeSession.poll() hands out."""

from __future__ import annotations

from stacklens.cct import Frame


try:
    from _collections import _tuplegetter  # what collections.namedtuple uses (C, ~20 ns a read)
except ImportError:  # pragma: no cover - other Pythons
    from operator import itemgetter as _ig

    def _tuplegetter(i, doc):
        return property(_ig(i), doc=doc)

_tnew = tuple.__new__
_tget = tuple.__getitem__
EVENT_FIELDS = ("kind", "api", "pid", "tid", "ktime_ns", "duration_ns", "args", "op_path", "native_stack",
                "py_stack", "kernel_name", "bytes", "direction", "ret", "py_entries", "bwd_node")
_ARGS_I = 6


class Event(tuple):
    """One GPU API call or CPU sample of the target (immutable).

    kind: "launch" | "graph" | "alloc" | "free" | "memcpy" | "sync" | "cpu_sample" |
        "autograd_node" (a forward op created an autograd node) | "autograd_eval" (the engine
        runs one): args {"node": address, "seq": sequence number, "thread": forward thread id,
        "layout": torch's Node layout}, api = the node's class ("AddmmBackward0") for evals
    api: the probed symbol ("cuLaunchKernel"), "" for samples
    ktime_ns: CLOCK_MONOTONIC at the call's entry (or the sample)
    duration_ns: time inside the call for return-probed APIs (syncs, allocs, copies), else 0
    args: decoded arguments by name (grid_x, block_z, shared_mem, stream, bytesize, ...)
    op_path: live framework operators of the thread, outermost first ("aten::linear", "aten::addmm")
    native_stack: outermost first; starts with Frame.other("[truncated]") when the unwind was cut
    py_stack: outermost first, read in BPF at the probe (pystack.h); empty for threads that run no
        Python and for unsupported interpreters; `[python stack lost]` if evicted before read
    py_entries: aligned with py_stack: True where one eval-loop (_PyEval_EvalFrameDefault)
        invocation begins — where native frames splice in (daemon/join/joiner.py splice())
    kernel_name: launches: kernel name, or "unresolved:0x..." when the handle's name was not seen
    bytes: allocs/frees/copies; direction: copies ("HtoD", "DtoH", "DtoD", "HtoH", "default")
    ret: return value (return-probed APIs)
    bwd_node: launches and samples: the autograd node the thread was evaluating (0: none)

    Behaves like the frozen dataclass it was (keyword constructor with the same defaults, fields
    by name, immutable, `==` and hash ignore `args` and `py_entries`, dataclass-style repr), but
    is a tuple underneath: the loader builds up to a million of these a second, and a tuple
    subclass is built in ~0.2 µs where an instance dict took ~0.6 µs. The loader stores the
    raw argument values (ProbeSpec, raw tuple, blob) in `args`' slot; they are decoded into the
    dict on access (most consumers never read `args`).
    """

    __slots__ = ()
    _fields = EVENT_FIELDS

    def __new__(cls, kind: str, api: str, pid: int, tid: int, ktime_ns: int, duration_ns: int = 0,
                args: dict | None = None, op_path: tuple[str, ...] = (), native_stack: tuple[Frame, ...] = (),
                py_stack: tuple[Frame, ...] = (), kernel_name: str = "", bytes: int = 0, direction: str = "",
                ret: int = 0, py_entries: tuple[bool, ...] = (), bwd_node: int = 0) -> "Event":
        return _tnew(cls, (kind, api, pid, tid, ktime_ns, duration_ns, {} if args is None else args, op_path,
                           native_stack, py_stack, kernel_name, bytes, direction, ret, py_entries, bwd_node))

    kind = _tuplegetter(0, "event kind")
    api = _tuplegetter(1, "probed symbol")
    pid = _tuplegetter(2, "process id")
    tid = _tuplegetter(3, "thread id")
    ktime_ns = _tuplegetter(4, "CLOCK_MONOTONIC at entry")
    duration_ns = _tuplegetter(5, "time inside the call (return probes)")
    op_path = _tuplegetter(7, "live operators, outermost first")
    native_stack = _tuplegetter(8, "native frames, outermost first")
    py_stack = _tuplegetter(9, "Python frames, outermost first")
    kernel_name = _tuplegetter(10, "kernel name (launches)")
    bytes = _tuplegetter(11, "bytes (allocs, frees, copies)")
    direction = _tuplegetter(12, "copy direction")
    ret = _tuplegetter(13, "return value (return probes)")
    py_entries = _tuplegetter(14, "eval-loop entry flags aligned with py_stack")
    bwd_node = _tuplegetter(15, "autograd node being evaluated (0: none)")

    @property
    def args(self) -> dict:
        v = _tget(self, _ARGS_I)
        if type(v) is tuple:  # raw from the loader: (ProbeSpec, raw values, blob)
            return v[0].decode(v[1], v[2])
        return v

    def _cmp(self) -> tuple:
        return _tget(self, slice(0, 6)) + _tget(self, slice(7, 14)) + _tget(self, slice(15, 16))

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._cmp() == other._cmp()

    def __ne__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._cmp() != other._cmp()

    def __hash__(self) -> int:
        return hash(self._cmp())

    __lt__ = __le__ = __gt__ = __ge__ = lambda self, other: NotImplemented  # unordered, as before

    def __repr__(self) -> str:
        vals = ", ".join(f"{n}={getattr(self, n)!r}" for n in EVENT_FIELDS)
        return f"Event({vals})"

    def __getnewargs__(self) -> tuple:
        return tuple(self)

    def _asdict(self) -> dict:
        return {n: getattr(self, n) for n in EVENT_FIELDS}

    def with_duration(self, duration_ns: int) -> "Event":
        """The same call with another duration (a one-shot window cuts a call at its end)."""
        return _tnew(Event, _tget(self, slice(0, 5)) + (duration_ns,) + _tget(self, slice(6, None)))


def make_event(kind, api, pid, tid, ktime_ns, duration_ns, args, op_path, native_stack, py_stack,
               kernel_name="", nbytes=0, direction="", ret=0, py_entries=(), bwd_node=0) -> Event:
    """Same result as Event(...), positional and without the defaults' handling."""
    return _tnew(Event, (kind, api, pid, tid, ktime_ns, duration_ns, args, op_path, native_stack, py_stack,
                         kernel_name, nbytes, direction, ret, py_entries, bwd_node))
