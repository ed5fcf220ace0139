"""stacklens.inject: attach the in-process agent to a running CPython process by PID.

    srv = AgentServer(pid, socket_dir)
    inject_agent(pid, socket_path=srv.path, timeout_s=5)
    srv.poll() -> [PySample | KernelRecord | ApiRecord | MemcpyRecord | SyncRecord | Note | ...]
    srv.stop_agent(); srv.close()
"""

from stacklens.inject.injector import AttachResult, inject_agent
from stacklens.inject.records import (AgentHello, AgentRecord, AgentStats, ApiRecord, KernelRecord, MemcpyRecord,
                      Note, PySample, SyncRecord)
from stacklens.inject.server import AgentServer

__all__ = ["AgentServer", "inject_agent", "AttachResult", "AgentRecord", "AgentHello", "AgentStats",
           "PySample", "KernelRecord", "ApiRecord", "MemcpyRecord", "SyncRecord", "Note"]
