"""stacklens.inject: attach the in-process agent to a running CPython process by PID.

    srv = AgentServer(pid, socket_dir)
    inject_agent(pid, socket_path=srv.path, timeout_s=5)
    srv.poll() -> [PySample | KernelRecord | ApiRecord | MemcpyRecord | SyncRecord | Note | ...]
    srv.stop_agent(); srv.close()
"""

# Loaded on first use (PEP 562): importing a submodule (pep768, validate) does not pull in the
# injector and the socket server (ctypes, ptrace). The record types live in stacklens.records.
_WHERE = {"inject_agent": "stacklens.inject.injector", "AttachResult": "stacklens.inject.injector",
          "AgentServer": "stacklens.inject.server",
          **{n: "stacklens.records.agent" for n in ("AgentRecord", "AgentHello", "AgentStats", "PySample",
                                                    "KernelRecord", "ApiRecord", "MemcpyRecord", "SyncRecord",
                                                    "Note")}}

__all__ = ["AgentServer", "inject_agent", "AttachResult", "AgentRecord", "AgentHello", "AgentStats",
           "PySample", "KernelRecord", "ApiRecord", "MemcpyRecord", "SyncRecord", "Note"]


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'stacklens.inject' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value
