"""Shared harness of the analyzer scenarios (tests/targets/scenario_*.py).

Each scenario defines `make(fixed: bool) -> step` (a closure running one iteration of the
workload with the problem, or with its fix). This module gives every scenario the same CLI:

    python tests/targets/scenario_X.py [--fixed]                 # print `ready`, loop until killed
                                                                 # (a target for `stacklens profile --pid`)
    python tests/targets/scenario_X.py [--fixed] --record OUT.json [--seconds 3]
    python tests/targets/scenario_X.py --bench [--seconds 3]     # time problem vs fixed in one run

`--record` is the stand-in recorder used until the BPF pipeline records torch CPU processes:
a real run of the workload, observed in-process by
  * torch.profiler (CPU activity, memory): operator intervals with their nesting, autograd
    sequence numbers, allocation events;
  * a sampler thread reading the main thread's Python stack every 1 ms (wall clock, like the
    stacklens agent's `py_samples`);
  * a TorchFunctionMode logging the Python stack at every torch call, so that backward operators
    can be charged to the forward line that created them (through sequence numbers, as
    DeepContext does).
Each sample becomes a path  py frames → op frames  in a stacklens CCT (`py_samples` += 1);
allocations add `alloc_bytes` to the path of the op that made them. Metrics this recorder does
not measure (cpu_samples, GPU metrics) are saved as unavailable. meta.recorder says which
recorder made a file.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from stacklens.cct import CCT, METRICS, Frame
from stacklens.cct.export import save

RECORDER = "tests/targets/scenario_recorder.py (torch.profiler + in-process sampler)"
SAMPLE_S = 0.001
_HERE = os.path.abspath(__file__)
_SKIP_FILES = (_HERE, threading.__file__)


def _py_stack(frame) -> tuple[tuple[Frame, ...], bool]:
    """The Python stack, outermost first, without this recorder's frames; and whether the
    recorder's own code was running (a sample of its overhead unless an op is active)."""
    out = []
    in_recorder = False
    while frame is not None:
        code = frame.f_code
        file = code.co_filename
        if file == _HERE:
            if code.co_name == "__torch_function__":
                out.clear()  # what the call log ran is the recorder's business
                in_recorder = True
        elif file not in _SKIP_FILES and not file.endswith("torch/overrides.py"):
            out.append(Frame.python(_short(file), code.co_name, frame.f_lineno or 0))
        frame = frame.f_back
    out.reverse()
    return tuple(out), in_recorder


_short_cache: dict[str, str] = {}


def _short(path: str) -> str:
    short = _short_cache.get(path)
    if short is None:
        short = _short_cache[path] = _short_uncached(path)
    return short


def _short_uncached(path: str) -> str:
    # Repository-relative for scenario files, package-relative for libraries: stable labels.
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
    return os.path.relpath(path, root) if path.startswith(root) else path


class _CallLog(TorchFunctionMode):
    """Python stack at each torch call on the main thread: (time_ns, stack)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[int] = []
        self.stacks: list[tuple[Frame, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.times.append(time.time_ns())
        self.stacks.append(_py_stack(sys._getframe(1))[0])
        return func(*args, **(kwargs or {}))


def record(step: Callable[[], object], *, seconds: float, meta: dict, link_backward: bool = False) -> object:
    """Run `step` for about `seconds` under the recorders; returns a Snapshot.

    `link_backward` turns on the call log that charges backward ops to their forward line; it
    costs a few µs per torch call (dropped from the samples, but it slows the loop down), so
    scenarios without autograd leave it off."""
    from torch.profiler import ProfilerActivity, profile

    main = threading.get_ident()
    samples: list[tuple[int, tuple[tuple[Frame, ...], bool]]] = []
    stop = threading.Event()

    def sampler() -> None:
        frames = sys._current_frames
        while not stop.is_set():
            f = frames().get(main)
            if f is not None:
                samples.append((time.time_ns(), _py_stack(f)))
            time.sleep(SAMPLE_S)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(SAMPLE_S / 2)
    log = _CallLog()
    thread = threading.Thread(target=sampler, daemon=True)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # On a GPU every launch needs its Python line: the call log is always on there.
    with profile(activities=activities, profile_memory=True) as prof:
        with log if (link_backward or cuda) else contextlib.nullcontext():
            t0 = time.time_ns()
            thread.start()
            iters = 0
            while time.time_ns() - t0 < seconds * 1e9 or iters < 3:
                step()
                iters += 1
            t_drain = time.time_ns()
            if cuda:
                torch.cuda.synchronize()  # the recorder's own wait: dropped below
            stop.set()
            thread.join()
            t1 = time.time_ns()
    sys.setswitchinterval(old_interval)

    events = [e for e in prof.profiler.kineto_results.events()
              if not getattr(e, "is_python_function", lambda: False)()]
    gpu = _gpu_events(events)
    cpu_events = [e for e in events if id(e) not in gpu["device_ids"] and e.name() != "[memory]"]
    ops_by_tid: dict[int, list] = {}
    for e in cpu_events:
        if e.name() in _NOT_OPS or e.duration_ns() < 0 or _RUNTIME.match(e.name()):
            continue
        ops_by_tid.setdefault(e.start_thread_id(), []).append((e.start_ns(), e.start_ns() + e.duration_ns(), e))
    for lst in ops_by_tid.values():
        lst.sort(key=lambda x: (x[0], -x[1]))
    # The main thread is the one whose first op starts first: forward runs there.
    main_tid = min(ops_by_tid, key=lambda t: ops_by_tid[t][0][0]) if ops_by_tid else 0

    sample_times = [t for t, _ in samples]

    def stack_at(t: int) -> tuple[Frame, ...]:
        """Python stack at time t: from the call log when on, else the last sample before t."""
        if log.times:
            i = bisect.bisect_right(log.times, t) - 1
            return log.stacks[i] if i >= 0 else ()
        i = bisect.bisect_right(sample_times, t) - 1
        return samples[i][1][0] if i >= 0 else ()

    # Forward line of every autograd sequence number: the Python stack of the forward op.
    fwd_stack: dict[int, tuple[Frame, ...]] = {}
    for start, _, e in ops_by_tid.get(main_tid, ()):
        seq = e.sequence_nr()
        if seq >= 0 and "Backward" not in e.name() and "autograd::" not in e.name() and seq not in fwd_stack:
            fwd_stack[seq] = stack_at(start)

    tree = CCT(METRICS + ("py_samples",), max_nodes=100_000)
    # Queries per thread: (time, kind, payload); kind 0 sample, 1 allocation, 2 GPU API call.
    queries: dict[int, list] = {main_tid: [(t, 0, s) for t, s in samples]}
    queries[main_tid] += [(t, 1, n) for t, n, tid in _allocations(events) if tid == main_tid]
    for api_ev in gpu["api"]:
        if api_ev.start_ns() >= t_drain and _SYNC.search(api_ev.name()):
            continue
        queries.setdefault(api_ev.start_thread_id(), []).append((api_ev.start_ns(), 2, api_ev))
    overhead = 0
    for tid, qs in queries.items():
        qs.sort(key=lambda x: (x[0], x[1]))
        ops = ops_by_tid.get(tid, [])
        active: list = []
        k = 0
        for t, kind, payload in qs:
            while k < len(ops) and ops[k][0] <= t:
                while active and active[-1][1] <= ops[k][0]:
                    active.pop()
                active.append(ops[k])
                k += 1
            while active and active[-1][1] <= t:
                active.pop()
            op_frames = tuple(Frame.op(e.name()) for _, _, e in active)
            if kind == 0:
                py, in_recorder = payload
                if in_recorder and not active:
                    overhead += 1  # the call log's own Python time, not the workload's
                    continue
            elif tid != main_tid:
                py = ()
            elif log.times or not active:
                py = stack_at(t)
            else:
                # No call log: the Python stack of a sample taken inside the same outermost op,
                # else of the next sample (the op is still running when it is taken).
                start, end, _ = active[0]
                i = bisect.bisect_left(sample_times, start)
                if i < len(samples) and sample_times[i] <= end:
                    py = samples[i][1][0]
                else:
                    j = bisect.bisect_left(sample_times, t)
                    py = samples[j][1][0] if j < len(samples) else stack_at(t)
            for _, _, e in active:
                if e.name().startswith("autograd::engine::evaluate_function") or e.name().endswith("Backward0"):
                    fwd = fwd_stack.get(e.sequence_nr())
                    if fwd:
                        py = fwd
                    break
            if kind == 0:
                tree.add(py + op_frames, "py_samples", 1)
            elif kind == 1:
                tree.add(py + op_frames, "alloc_bytes", payload)
            else:
                _add_api(tree, py + op_frames, payload, gpu)
    unmeasured = set(METRICS) - {"alloc_bytes"}
    if gpu["api"]:
        unmeasured -= {"gpu_time_ns", "kernel_count", "launch_count", "api_cpu_ns", "sync_wait_ns", "copy_bytes"}
    meta = dict(meta, recorder=RECORDER, duration_s=round((t1 - t0) / 1e9, 4), sample_hz=round(1 / SAMPLE_S),
                iterations=iters, samples=len(samples) - overhead, recorder_overhead_samples_dropped=overhead, torch=torch.__version__, synthetic=False)
    return tree.snapshot(meta=meta, unavailable=unmeasured)


_RUNTIME = re.compile(r"^(cuda|cu|hip)[A-Z]")
_SYNC = re.compile(r"Synchronize")
_NOT_OPS = {"[memory]", "Activity Buffer Request", "Buffer Flush"}  # the profiler's own annotations


def _is_device(e) -> bool:
    return str(e.device_type()).split(".")[-1].upper() in ("CUDA", "HIP", "PRIVATEUSE1") or e.name().startswith(("Memcpy", "Memset"))


def _gpu_events(events) -> dict:
    """Runtime API calls (CPU side) and the device activities they caused, by correlation id."""
    device = [e for e in events if _is_device(e) and e.name() != "[memory]"]
    api = [e for e in events if not _is_device(e) and _RUNTIME.match(e.name())]
    by_corr: dict[int, list] = {}
    for d in device:
        by_corr.setdefault(d.correlation_id(), []).append(d)
    return {"api": api, "device": by_corr, "device_ids": {id(d) for d in device}}


def _copy_bytes(d) -> int:
    try:
        n = int(d.nbytes())
    except Exception:
        n = 0
    if n <= 0:
        m = re.search(r'"bytes":\s*(\d+)', d.metadata_json() or "")
        n = int(m.group(1)) if m else 0
    return n


def _add_api(tree: CCT, prefix: tuple[Frame, ...], api_ev, gpu: dict) -> None:
    name = api_ev.name()
    path = prefix + (Frame.api(name),)
    dur = max(0, api_ev.duration_ns())
    if _SYNC.search(name):
        tree.add(path, "sync_wait_ns", dur)
    else:
        tree.add(path, "api_cpu_ns", dur)
    for d in gpu["device"].get(api_ev.correlation_id(), ()):
        dname = d.name()
        if dname.startswith("Memcpy"):
            tree.add(path, "copy_bytes", _copy_bytes(d))
        elif dname.startswith("Memset"):
            continue
        else:
            tree.add_many(path + (Frame.kernel(dname),),
                          {"gpu_time_ns": max(0, d.duration_ns()), "kernel_count": 1, "launch_count": 1})


def _allocations(events):
    out = []
    for e in events:
        if e.name() == "[memory]":
            try:
                n = int(e.nbytes())
            except Exception:
                continue
            if n > 0:
                out.append((e.start_ns(), n, e.start_thread_id()))
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(make: Callable[[bool], Callable[[], object]], seconds: float) -> dict[str, float]:
    """Seconds per iteration of the problem and of the fix, measured in this one process
    (on a GPU, up to the completion of the queued work)."""
    out = {}
    for fixed in (False, True, False, True):
        step = make(fixed)
        for _ in range(3):
            step()
        _sync()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 4:
            step()
            n += 1
        _sync()
        per = (time.perf_counter() - t0) / n
        key = "fixed" if fixed else "problem"
        out[key] = min(out.get(key, per), per)
    out["speedup"] = out["problem"] / out["fixed"]
    return out


def main(
    name: str, make: Callable[[bool], Callable[[], object]], argv: list[str] | None = None, link_backward: bool = False
) -> None:
    ap = argparse.ArgumentParser(description=f"analyzer scenario {name}")
    ap.add_argument("--fixed", action="store_true", help="run the workload with the fix applied")
    ap.add_argument("--record", metavar="OUT", help="record a profile with the in-process recorder")
    ap.add_argument("--bench", action="store_true", help="time the problem and the fix in one run")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.bench:
        r = bench(make, args.seconds)
        where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU, 1 thread"
        print(f"{name}: problem {r['problem'] * 1e3:.3f} ms/iter, fixed {r['fixed'] * 1e3:.3f} ms/iter, "
              f"speed-up {r['speedup']:.2f}x (torch {torch.__version__}, {where})", flush=True)
        return
    step = make(args.fixed)
    if args.record:
        for _ in range(3):
            step()
        snap = record(step, seconds=args.seconds, meta={"scenario": name, "fixed": args.fixed}, link_backward=link_backward)
        save(snap, args.record)
        print(f"recorded {args.record}: {snap!r}", flush=True)
        return
    print(f"ready pid={os.getpid()} scenario={name} fixed={args.fixed}", flush=True)
    while True:
        step()
