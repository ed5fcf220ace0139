"""stacklens.inject: attach the in-process agent to a running CPython process by PID.

    srv = AgentServer(pid, socket_dir)
    inject_agent(pid, socket_path=srv.path, timeout_s=5)
    srv.poll() -> [PySample | KernelRecord | ApiRecord | MemcpyRecord | SyncRecord | Note | ...]
    srv.stop_agent(); srv.close()
"""

# Loaded on first use (PEP 562): the pure parts that need only the record types (the join) import
# stacklens.inject.records without pulling in the injector and the socket server (ctypes, ptrace).
_WHERE = {"inject_agent": "injector", "AttachResult": "injector", "AgentServer": "server",
          **{n: "records" for n in ("AgentRecord", "AgentHello", "AgentStats", "PySample", "KernelRecord",
                                    "ApiRecord", "MemcpyRecord", "SyncRecord", "Note")}}

__all__ = ["AgentServer", "inject_agent", "AttachResult", "AgentRecord", "AgentHello", "AgentStats",
           "PySample", "KernelRecord", "ApiRecord", "MemcpyRecord", "SyncRecord", "Note"]


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'stacklens.inject' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"stacklens.inject.{where}"), name)
    globals()[name] = value
    return value
