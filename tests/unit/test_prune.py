"""GetSnapshot's depth/top_k pruning (daemon/grpc_service.prune): what is cut is charged to the
nearest kept ancestor, so totals, kept inclusive values and the breakdown by thread stay exact."""

from __future__ import annotations

from stacklens.cct import CCT, Frame
from stacklens.daemon.grpc_service import prune


def _py(name: str, line: int = 1) -> Frame:
    return Frame.python("/srv/train.py", name, line)


def _snap():
    t = CCT(metrics=("cpu_samples", "gpu_time_ns"))
    main = _py("main")
    for i, (tid, n) in enumerate(((101, 5), (102, 3), (101, 2))):
        path = (main, _py(f"layer{i}", 10 + i), _py("leaf", 40))
        for _ in range(n):
            t.add_sample(path, "cpu_samples", tid)
        t.add_many(path, {"gpu_time_ns": 1000 * (i + 1)})
    return t.snapshot()


def _by_thread(snap) -> dict[int, int]:
    out: dict[int, int] = {}
    for n in range(snap.node_count):
        for tid, c in snap.threads(n, "cpu_samples"):
            out[tid] = out.get(tid, 0) + c
    return out


def test_depth_and_top_k_keep_totals_and_threads():
    snap = _snap()
    for depth, top_k in ((1, 0), (2, 0), (0, 1), (2, 2)):
        p = prune(snap, "cpu_samples", depth, top_k)
        assert p.total("cpu_samples") == snap.total("cpu_samples") == 10
        assert p.total("gpu_time_ns") == snap.total("gpu_time_ns") == 6000
        assert _by_thread(p) == _by_thread(snap) == {101: 7, 102: 3}
    p = prune(snap, "cpu_samples", 2, 1)            # main → layer0 kept; the rest charged to main
    kept = {p.frame_of(n).name for n in range(1, p.node_count)}
    assert kept == {"main", "layer0"}
