"""The few lines of Python that the target runs at its next safe point.

They start one daemon thread, name it ``stacklens-agent`` in /proc (its ``comm``: the
injector's evidence that the bootstrap ran even when no hello comes back), and return. That
thread connects to the daemon's socket (and exits
silently if nobody listens: a late pending call after a withdrawn attach is harmless), loads the
agent from its read-only directory without writing bytecode, runs it, and on the way out closes
the socket and removes the agent's modules from ``sys.modules``. A child forked meanwhile closes
its copy of the socket: one ``os.register_at_fork`` hook per process (it cannot be unregistered),
registered by the first attach and kept with the sockets of the agents attached now in a
``sys.modules`` entry of its own (``_stacklens_fork``, FORK_HOOK); after detach it holds an empty
list. Nothing is bound in the namespace the text runs in (``__main__`` on 3.10–3.13): the body
runs under ``exec`` in a fresh dict.
"""

from __future__ import annotations

THREAD_NAME = "stacklens-agent"

# While the agent is attached the GIL switch interval is at most this (restored at detach). Why:
# a thread waiting for the GIL asks the holder to drop it only after a *quiet* interval; a main
# thread that releases and re-takes the GIL more often than that (a syscall every few ms) wakes
# the waiter each time and wins the race to re-take it, so the agent thread starves — measured
# (gdb): agent in take_gil, gil_drop_request never set, main thread never switching. Below the
# target's own release period the waiter times out, sets the drop request, and CPython's forced
# switching hands it the GIL.
SWITCH_INTERVAL_S = 0.0005
# sys.modules entry, present while an agent runs: the program's own interval and how many agents
# run on the fast one. An agent finishing its detach while the next one starts must not restore
# the program's interval under it (measured: the next agent then starved and never stopped).
GIL_STATE_MODULE = "_stacklens_gil"
# sys.modules entry, for the process's life from the first attach on: the one at-fork hook and the
# (socket, release) of each agent attached now. The hook's globals are this module's own, so it
# keeps nothing of any attach's namespace alive.
FORK_MODULE = "_stacklens_fork"
FORK_HOOK = """
held = []
def in_child():
    # a child forked while attached (DataLoader workers) must not hold an agent's socket: the
    # daemon would see no end of the connection while it lives; no agent runs in the child
    while held:
        try:
            s, release = held.pop()
            s.close()
            release()
        except BaseException:
            pass
"""

_BODY = '''
try:
    import sys, threading
    if not any(t.name == {name!r} for t in threading.enumerate()):
        import types
        gil = sys.modules.get({gil!r})
        if gil is None:                   # the program's interval, kept while any agent runs
            gil = types.ModuleType({gil!r})
            gil.prev = sys.getswitchinterval()
            gil.users = 0
            gil.fast = min(gil.prev, {switch_s!r})
            sys.modules[{gil!r}] = gil
        gil.users += 1
        def release(gil=gil):
            # the last agent out restores the program's interval (unless it changed it since):
            # an exiting agent must not undo the fast interval the next one runs on
            gil.users -= 1
            if gil.users <= 0:
                sys.modules.pop({gil!r}, None)
                if sys.getswitchinterval() == gil.fast:
                    sys.setswitchinterval(gil.prev)
        def run(path={sock!r}, d={agent_dir!r}, token={token!r}, name={modname!r}):
            import socket
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(5.0)
                s.connect(path)
            except OSError:
                s.close()
                release()
                return
            import types
            entry = (s, release)
            try:
                fork = sys.modules.get({fork!r})
                if fork is None:          # the first attach of this process: the one hook
                    fork = types.ModuleType({fork!r})
                    exec({fork_hook!r}, fork.__dict__)
                    import os
                    os.register_at_fork(after_in_child=fork.in_child)
                    sys.modules[{fork!r}] = fork
                fork.held.append(entry)
            except BaseException:
                pass
            try:
                m = types.ModuleType(name)
                m.__file__ = d + '/__init__.py'
                m.__path__ = [d]
                m.__package__ = name
                sys.modules[name] = m
                with open(m.__file__, 'rb') as f:
                    exec(compile(f.read(), m.__file__, 'exec'), m.__dict__)
                m.main(s, token)
            except BaseException:
                pass
            finally:
                # the program's interval last, after the socket's close (which drops the GIL):
                # on the program's interval this thread, once it lets go of the GIL, may wait
                # long to take it back from a main thread that releases it often (measured: an
                # agent thread alive 5 s after its detach under load); from release() on it
                # runs a few bytecodes and exits without letting go
                for n in [n for n in list(sys.modules) if n.split('.')[0] == name]:
                    sys.modules.pop(n, None)
                s.close()
                fork = sys.modules.get({fork!r})
                try:
                    fork.held.remove(entry)   # the hook stays registered: this socket is not its any more
                except BaseException:
                    pass
                release()
        if sys.getswitchinterval() > gil.fast:
            sys.setswitchinterval(gil.fast)
        t = threading.Thread(target=run, name={name!r}, daemon=True)
        try:
            t.start()
        except BaseException:
            release()
            raise
        try:
            with open('/proc/self/task/%d/comm' % t.native_id, 'w') as f:
                f.write({name!r}[:15])
        except BaseException:
            pass
except BaseException:
    pass
'''


def _code(text: str) -> str:
    """`text` without its comment lines: they document the source here, and the pending call's
    text must fit one page (inject/ptrace_inject.py MAX_TEXT)."""
    return "\n".join(ln for ln in text.split("\n") if not ln.lstrip().startswith("#"))


def bootstrap_body(socket_path: str, agent_dir: str, token: str, nonce: str = "0") -> str:
    """``nonce`` (per attach) names the agent's modules, so an agent still finishing its detach
    (its thread already renamed "stacklens-agent-exiting") never removes the next one's modules."""
    for v in (socket_path, agent_dir, token, nonce):
        if not isinstance(v, str) or "\0" in v:
            raise ValueError("bad bootstrap parameter")
    if not nonce.isalnum():
        raise ValueError("nonce must be alphanumeric")
    return _code(_BODY.format(name=THREAD_NAME, sock=socket_path, agent_dir=agent_dir, token=token,
                              modname=f"_stacklens_agent_{nonce}", switch_s=SWITCH_INTERVAL_S,
                              gil=GIL_STATE_MODULE, fork=FORK_MODULE, fork_hook=_code(FORK_HOOK)))


def pending_call_text(socket_path: str, agent_dir: str, token: str, nonce: str = "0") -> bytes:
    """One statement for PyRun_SimpleString: exec the body in a fresh namespace."""
    return f"exec({bootstrap_body(socket_path, agent_dir, token, nonce)!r}, {{}})\n".encode()


def script_file_text(socket_path: str, agent_dir: str, token: str, nonce: str = "0") -> bytes:
    """The PEP 768 script (CPython already runs it in a fresh namespace)."""
    return bootstrap_body(socket_path, agent_dir, token, nonce).encode()
