"""The ROCm (roctracer) collector against a fake of its library interface.

The real ctypes binding is untested on AMD hardware (none here); these tests pin the contract
the collector relies on: pool callback delivery, domain enable/disable, flush, close, names.
"""

from stacklens.inject.agent import gpu as gpu_mod
from stacklens.inject.agent.gpu import rocm
from stacklens.inject.agent.gpu.rocm import RecordView, RocmCollector
from stacklens.inject.channel.messages import parse_message


class FakeRoctracer:
    def __init__(self):
        self.enabled, self.pool_open, self.flushes, self.pending, self.cb = set(), False, 0, [], None

    def open_pool(self, on_records):
        self.pool_open, self.cb = True, on_records

    def enable(self, d):
        assert self.pool_open
        self.enabled.add(d)

    def disable(self, d):
        self.enabled.discard(d)

    def flush(self):
        self.flushes += 1
        if self.pending:
            recs, self.pending = self.pending, []
            self.cb(recs)

    def close_pool(self):
        self.pool_open = False

    def timestamp(self):
        import time
        return time.monotonic_ns() - 5_000

    def op_string(self, domain, op, kind):
        return {(rocm.DOMAIN_HIP_API, 42): "hipLaunchKernel", (rocm.DOMAIN_HIP_API, 43): "hipStreamSynchronize"}.get(
            (domain, op), f"op{op}")


def test_rocm_collector_round_trip():
    lib, rows, notes = FakeRoctracer(), [], []
    c = RocmCollector(lambda lvl, m: notes.append(m), lib=lib, gpu=gpu_mod)
    assert c.start(lambda k, r: rows.append((k, r)))
    assert lib.enabled == {rocm.DOMAIN_HIP_OPS, rocm.DOMAIN_HIP_API}
    assert any("untested on AMD hardware" in n for n in notes)
    lib.pending = [
        RecordView(rocm.DOMAIN_HIP_OPS, rocm.HIP_OP_DISPATCH, 0, 1, 100, 300, device_id=0, queue_id=3,
                   kernel_name="Cijk_gemm"),
        RecordView(rocm.DOMAIN_HIP_OPS, rocm.HIP_OP_COPY, 0, 2, 10, 20, device_id=0, queue_id=3, bytes=4096),
        RecordView(rocm.DOMAIN_HIP_OPS, rocm.HIP_OP_BARRIER, 0, 3, 30, 40, queue_id=3),
        RecordView(rocm.DOMAIN_HIP_API, 42, 0, 1, 50, 60, thread_id=99),
        RecordView(rocm.DOMAIN_HIP_API, 43, 0, 4, 70, 90, thread_id=99),
        RecordView(rocm.DOMAIN_HIP_OPS, rocm.HIP_OP_DISPATCH, 0, 5, 300, 100),   # bogus: ends first
    ]
    c.poll()
    assert [k for k, _ in rows] == ["kernel", "memcpy", "sync", "api", "api", "sync"]
    off = c.clock.offset_ns
    assert rows[0][1][:3] == ["Cijk_gemm", 100 + off, 300 + off]
    assert rows[3][1][:3] == ["hip", "hipLaunchKernel", 99]
    for kind, row in rows:
        assert parse_message({"t": kind, "r": [row]})
    assert c.stats()["unknown"] == 1
    c.stop()
    assert lib.enabled == set() and not lib.pool_open


def test_rocm_without_library_is_a_note(monkeypatch):
    def nolib(*a, **k):
        raise OSError("libroctracer64.so: cannot open shared object file")

    monkeypatch.setattr(rocm, "CtypesRoctracer", nolib)
    notes = []
    c = RocmCollector(lambda lvl, m: notes.append(m), gpu=gpu_mod)
    assert c.start(lambda k, r: None) is False
    assert "libroctracer64 not found" in notes[0]


def test_record_struct_layout_matches_roctracer_h():
    import ctypes
    assert ctypes.sizeof(rocm._Record) == 64
    assert rocm._Record.correlation_id.offset == 16 and rocm._Record.u0.offset == 40
