"""Fakes for the TUI's sources and synthetic snapshots, for tests and the benchmark.

No privilege, no I/O. `FakeSource` / `FakeProcesses` implement the `SnapshotSource` and
`ProcessSource` protocols over snapshots built here.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable

from stacklens import errors
from stacklens.cct import Frame
from stacklens.tui.model import Advice, Evidence, ProcessRow
from stacklens.tui.source import Fetched

from stacklens.cct import CCT, METRICS

PY_TRAIN = "/srv/job/train.py"
PY_MODEL = "/srv/job/model.py"


def sample_snapshot(scale: int = 1, *, gpu: bool = True) -> Any:
    """A small training-step profile: forward GEMMs, an elementwise op, a `.item()` sync, a loader."""
    t = CCT(METRICS, max_nodes=None)
    step = (Frame.python(PY_TRAIN, "<module>", 120), Frame.python(PY_TRAIN, "main", 101), Frame.python(PY_TRAIN, "train_step", 42))
    fwd = step + (Frame.python(PY_MODEL, "forward", 88),)
    gemm = fwd + (
        Frame.op("aten::linear"),
        Frame.op("aten::addmm"),
        Frame.native("libtorch_cuda.so", "at::native::addmm_out_cuda"),
        Frame.api("cuLaunchKernel"),
        Frame.kernel("sm90_xmma_gemm_f32f32_tn"),
    )
    relu = fwd[:-1] + (Frame.python(PY_MODEL, "forward", 90), Frame.op("aten::relu"), Frame.api("cuLaunchKernel"), Frame.kernel("vectorized_elementwise_kernel"))
    item = step[:-1] + (Frame.python(PY_TRAIN, "train_step", 47), Frame.op("aten::item"), Frame.op("aten::_local_scalar_dense"), Frame.api("cuStreamSynchronize"))
    loader = step[:-1] + (Frame.python("/srv/job/data.py", "__next__", 20), Frame.native("libc.so.6", "read"))
    for _ in range(scale):
        t.add_many(gemm, {"gpu_time_ns": 6_400_000, "kernel_count": 48, "launch_count": 48, "api_cpu_ns": 250_000, "cpu_samples": 3})
        t.add_many(gemm[:-1], {"cpu_samples": 2})
        t.add_many(relu, {"gpu_time_ns": 900_000, "kernel_count": 96, "launch_count": 96, "api_cpu_ns": 480_000, "cpu_samples": 5})
        t.add_many(item, {"sync_wait_ns": 4_100_000, "cpu_samples": 4, "copy_bytes": 4})
        t.add_many(loader, {"cpu_samples": 11, "alloc_bytes": 1 << 20})
    unavailable = set() if gpu else {"gpu_time_ns", "kernel_count"}
    # cpu_hz: the daemon's CPU sampling rate, which every session's meta carries
    snap = t.snapshot(meta={"pid": 4242, "comm": "python", "cpu_hz": 99}, unavailable=unavailable)
    return snap


SITE = "/opt/venv/lib/python3.12/site-packages"


def gpt2_snapshot() -> Any:
    """SYNTHETIC (hand-built, invented values): one GPT-2 training step on a GPU as the daemon
    records it with the agent: module calls through torch's wrappers and transformers' decorators,
    each forward under the `module` frame the sampler names, ops, launches and kernels with GPU
    time. For the model view's looks; the recorded CPU run is tests/data/cpu_gpt2_train/."""
    t = CCT(METRICS, max_nodes=None)
    mod = f"{SITE}/torch/nn/modules/module.py"
    gpt2 = f"{SITE}/transformers/models/gpt2/modeling_gpt2.py"
    call = (Frame.python(mod, "Module._wrapped_call_impl", 1778), Frame.python(mod, "Module._call_impl", 1789))
    wrapper = Frame.python(f"{SITE}/transformers/utils/generic.py", "can_return_tuple.<locals>.wrapper", 1036)

    def module(path: str, cls: str, file: str, line: int, *, decorated: bool = False) -> tuple[Frame, ...]:
        return (*call, *((wrapper,) if decorated else ()), Frame.module(path, cls),
                Frame.python(file, f"{cls}.forward", line))

    step = (Frame.python(PY_TRAIN, "<module>", 120), Frame.python(PY_TRAIN, "train_step", 42))
    lm = step + module("", "GPT2LMHeadModel", gpt2, 1080, decorated=True)
    body = lm + module("transformer", "GPT2Model", gpt2, 920, decorated=True)
    launch = (Frame.api("cuLaunchKernel"),)
    for layer in range(2):
        block = body + module(f"transformer.h.{layer}", "GPT2Block", gpt2, 400)
        attn = block + module(f"transformer.h.{layer}.attn", "GPT2Attention", gpt2, 320)
        c_attn = attn + module(f"transformer.h.{layer}.attn.c_attn", "Conv1D", f"{SITE}/transformers/pytorch_utils.py", 120)
        t.add_many(c_attn + (Frame.op("aten::addmm"), *launch, Frame.kernel("sm90_xmma_gemm_f32f32_tn")),
                   {"gpu_time_ns": 2_400_000 + 100_000 * layer, "kernel_count": 1, "launch_count": 1, "cpu_samples": 1})
        t.add_many(attn + (Frame.op("aten::scaled_dot_product_attention"), *launch,
                           Frame.kernel("pytorch_flash::flash_fwd_kernel")),
                   {"gpu_time_ns": 1_800_000, "kernel_count": 1, "launch_count": 1, "cpu_samples": 2})
        mlp = block + module(f"transformer.h.{layer}.mlp", "GPT2MLP", gpt2, 280)
        c_fc = mlp + module(f"transformer.h.{layer}.mlp.c_fc", "Conv1D", f"{SITE}/transformers/pytorch_utils.py", 120)
        t.add_many(c_fc + (Frame.op("aten::addmm"), *launch, Frame.kernel("sm90_xmma_gemm_f32f32_tn")),
                   {"gpu_time_ns": 4_100_000, "kernel_count": 1, "launch_count": 1, "cpu_samples": 1})
    head = lm + module("lm_head", "Linear", f"{SITE}/torch/nn/modules/linear.py", 134)
    t.add_many(head + (Frame.op("aten::linear"), Frame.op("aten::mm"), *launch, Frame.kernel("sm90_xmma_gemm_f32f32_nn")),
               {"gpu_time_ns": 3_300_000, "kernel_count": 1, "launch_count": 1, "cpu_samples": 1})
    t.add_many(step[:-1] + (Frame.python(PY_TRAIN, "train_step", 44), Frame.op("aten::item"),
                            Frame.api("cuStreamSynchronize")), {"sync_wait_ns": 9_000_000, "cpu_samples": 3})
    return t.snapshot(meta={"pid": 4343, "comm": "python", "synthetic": True})


def synthetic_snapshot(n_nodes: int, *, seed: int = 0, fanout: int = 6, max_nodes: int | None = None) -> Any:
    """A random tree of about `n_nodes` nodes, Python frames over ops over kernels, all metrics set."""
    rng = random.Random(seed)
    t = CCT(METRICS, max_nodes=max_nodes)
    paths: list[tuple[Frame, ...]] = [()]
    kinds = (
        lambda i: Frame.python(f"/srv/job/mod{i % 50}.py", f"fn{i}", i % 400 + 1),
        lambda i: Frame.op(f"aten::op{i % 300}"),
        lambda i: Frame.native("libtorch_cuda.so", f"at::native::k{i}"),
        lambda i: Frame.kernel(f"kernel_{i}"),
    )
    i = 0
    while t.node_count < n_nodes:
        parent = paths[rng.randrange(len(paths))] if len(paths) > 1 else ()
        depth = len(parent)
        frame = kinds[min(3, depth // 3)](i)
        path = parent + (frame,)
        i += 1
        if len(path) < 24:
            paths.append(path)
        w = rng.randint(1, 1000)
        t.add_many(path, {"gpu_time_ns": w * 1000, "cpu_samples": w % 7, "launch_count": 1 + w % 3, "sync_wait_ns": (w % 11) * 100})
        if len(paths) > fanout * 50_000:
            paths = paths[-fanout * 10_000 :]
    return t.snapshot(meta={"synthetic": n_nodes})


class FakeSource:
    """A scripted `SnapshotSource`: `snapshots` is a callable of (window_s, diff) or a snapshot."""

    def __init__(
        self,
        snapshot: Any | Callable[[float | None, bool], Any] = None,
        *,
        name: str = "pid 4242 python",
        live: bool = True,
        windows: bool = True,
        state: str = "attached",
        stats: dict[str, int] | None = None,
        advice: list[Advice] | str | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.name = name
        self.live = live
        self.windows = windows
        self.state = state
        self.stats = stats if stats is not None else {"events": 1000, "drops": 3}
        self.error = ""
        self.final = False
        self.calls: list[tuple[float | None, bool]] = []
        self._advice = advice

    def fetch(self, window_s: float | None, diff: bool = False) -> Fetched:
        self.calls.append((window_s, diff))
        if self.error:
            return Fetched(None, state=self.state, error=self.error, final=self.final)
        snap = self.snapshot(window_s, diff) if callable(self.snapshot) else self.snapshot
        return Fetched(snap, self.state, dict(self.stats), final=self.final)

    def advice(self, window_s: float | None, snapshot: Any | None) -> list[Advice] | str:
        if self._advice is not None:
            return self._advice
        return sample_advice()


def sample_advice() -> list[Advice]:
    return [
        Advice(
            rule="sync-stall",
            severity="high",
            title=".item() at train.py:47 stalls the GPU 31% of each step",
            fix="keep the loss on the GPU and log it every N steps",
            path=(
                f"py:{PY_TRAIN}:<module>:120",
                f"py:{PY_TRAIN}:main:101",
                f"py:{PY_TRAIN}:train_step:47",
                "op:aten::item",
            ),
            evidence=(Evidence("sync_wait_ns", 4.1e6, "ns"),),
            saving_share=0.31,
        ),
        Advice(
            rule="small-kernels",
            severity="warning",
            title="96 small kernels launched from model.py:90",
            fix="fuse with torch.compile or a CUDA graph",
            path=(f"py:{PY_TRAIN}:<module>:120", f"py:{PY_TRAIN}:main:101", f"py:{PY_MODEL}:forward:90", "op:aten::relu"),
            evidence=(Evidence("launch_count", 96),),
            saving_share=0.05,
        ),
    ]


class FakeProcesses:
    """A scripted `ProcessSource`: attach/detach flip the rows; `down` makes every call fail.

    Each listing is read `period_s` after the last (a fake clock), and each process's CPU time
    grows by its `cpu_rate` (CPU seconds per second; missing: no CPU time in the reply)."""

    def __init__(self, rows: list[ProcessRow] | None = None, source: Callable[[int], Any] | None = None) -> None:
        self.rows = rows if rows is not None else [
            ProcessRow(4242, "python", True, False, "attached", "3.12", float("nan"), 1520.0, 0.31, ("gpu_time_ns",),
                       rank="0/2", probe_overhead=0.042),
            ProcessRow(5151, "python3", False, False, "detached", "3.11", 0.0, 0.0, 0.0),
        ]
        self.down = False
        self.period_s = 2.0
        self.cpu_rate: dict[int, float] = {4242: 1.5, 5151: 0.25}
        self.listings = 0
        self.attached: list[int] = []
        self.detached: list[int] = []
        self._source = source or (lambda pid: FakeSource(sample_snapshot(), name=f"pid {pid}"))

    def _check(self) -> None:
        if self.down:
            raise errors.DaemonUnavailable("stacklensd is not reachable at /tmp/s.sock: start it (`stacklensd`) or pass --socket")

    def processes(self) -> list[ProcessRow]:
        self._check()
        self.listings += 1
        t = self.listings * self.period_s
        return [dataclasses.replace(r, read_at=t, cpu_time_ns=round(self.cpu_rate[r.pid] * t * 1e9))
                if r.pid in self.cpu_rate else r for r in self.rows]

    def _set(self, pid: int, attached: bool) -> None:
        for i, r in enumerate(self.rows):
            if r.pid == pid:
                self.rows[i] = dataclasses.replace(r, attached=attached, state="attached" if attached else "detached")
                return
        raise errors.NoSuchProcess(f"no process {pid}")

    def attach(self, pid: int) -> list[str]:
        self._check()
        self._set(pid, True)
        self.attached.append(pid)
        return ["not applicable: no agent (GPU time unavailable)"]

    def detach(self, pid: int) -> None:
        self._check()
        self._set(pid, False)
        self.detached.append(pid)

    def open(self, pid: int) -> Any:
        return self._source(pid)
