"""GPU process discovery over a fake /proc tree (ProcFS(root=…))."""

from __future__ import annotations

import pytest

from stacklens.daemon.discovery import describe_process, scan
from stacklens.errors import NoSuchProcess
from stacklens.introspect.procfs import ProcFS

MAPS = {
    101: [
        "7f00-7f10 r-xp 00000000 08:01 11 /usr/lib/x86_64-linux-gnu/libcuda.so.580.1",
        "7f20-7f30 r-xp 00000000 08:01 12 /venv/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so",
        "7f40-7f50 r-xp 00000000 08:01 13 /usr/lib/libpython3.12.so.1.0",
    ],
    102: ["5500-5510 r-xp 00000000 08:01 21 /usr/bin/bash"],
    103: ["7f00-7f10 r-xp 00000000 08:01 31 /opt/rocm/lib/libamdhip64.so.6"],
}


@pytest.fixture
def procfs(tmp_path):
    for pid, lines in MAPS.items():
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "maps").write_text("\n".join(lines) + "\n")
        (d / "comm").write_text(f"proc{pid}\n")
        (d / "cgroup").write_text("0::/system.slice/docker-" + "ab" * 32 + ".scope\n" if pid == 103 else "0::/\n")
    return ProcFS(tmp_path)


def test_describe_finds_libraries_python_and_container(procfs):
    info = describe_process(101, procfs)
    assert info.gpu and info.comm == "proc101"
    assert info.libraries["libtorch_cpu"] == ["/venv/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so"]
    assert info.python.startswith("3.12")
    assert describe_process(103, procfs).container == "ab" * 6


def test_scan_lists_only_gpu_processes(procfs):
    assert [p.pid for p in scan(procfs)] == [101, 103]


def test_missing_pid_is_a_clear_error(procfs):
    with pytest.raises(NoSuchProcess, match="999"):
        describe_process(999, procfs)
    with pytest.raises(NoSuchProcess):
        describe_process(0, procfs)


def test_torch_and_jax_processes_are_found_gpu_or_not(tmp_path):
    """`ps` lists a CPU torch job and a JAX job too: worth a profile before any GPU is involved."""
    maps = {
        201: ["7f20-7f30 r-xp 00000000 08:01 12 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so"],
        202: ["7f20-7f30 r-xp 00000000 08:01 13 /venv/lib/python3.11/site-packages/jaxlib/_jax.so"],
        203: ["7f20-7f30 r-xp 00000000 08:01 14 /venv/lib/python3.10/site-packages/jaxlib/xla_extension.so"],
        204: ["5500-5510 r-xp 00000000 08:01 21 /usr/bin/python3.11"],
    }
    for pid, lines in maps.items():
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "maps").write_text("\n".join(lines) + "\n")
        (d / "comm").write_text("python3\n")
        (d / "cgroup").write_text("0::/\n")
    procfs = ProcFS(tmp_path)
    assert scan(procfs) == []                                  # auto-attach keeps to GPU processes
    found = {p.pid: p.frameworks for p in scan(procfs, gpu_only=False)}
    assert found == {201: ("torch",), 202: ("jax",), 203: ("jax",)}
