"""stacklens.inject: attach the in-process agent to a running CPython process by PID.

    srv = AgentServer(pid, socket_dir)                      # stacklens.inject.channel.server
    inject_agent(pid, socket_path=srv.path, timeout_s=5)    # stacklens.inject.injector
    srv.poll() -> [PySample | KernelRecord | ApiRecord | MemcpyRecord | SyncRecord | Note | ...]
    srv.stop_agent(); srv.close()

Getting code into a target lives here (``injector.py``, ``ptrace_inject.py``, ``pep768.py``,
``bootstrap.py``, ``rootpath.py``); the agent that runs in it in ``agent/``; the daemon's end of
its socket, the parsing and the GPU vendors' decoders in ``channel/``. The record types live in
``stacklens.records.agent``.
"""
