"""The agent channel, daemon side: what the injected agent sends, received and decoded.

``server.py`` (``AgentServer``: the socket per target, its reader thread, the API), its parts
``serverfiles.py`` (its lock, the agent's code and the socket, in the agent directory),
``admission.py`` (the peer's SO_PEERCRED pid, the hello's token), ``connection.py`` (one agent
connection read: frames, hello, messages), ``framing.py`` (frames and their size bounds),
``dispatch.py`` (a message to its decoder, rejections counted) and ``recordqueue.py`` (the records
waiting for ``poll()``, bounded by count and bytes); ``agentdir.py`` (the agent directories, their
locks, the stale-file sweep), ``messages.py`` (JSON messages -> records), ``validate.py`` (the
strict checks), ``inductor.py`` (torch.compile's generated modules) and ``gpu/`` (the GPU vendors:
their declaration, ``VENDORS``, and one decoder each, which owns its transport). Runs in the
daemon; the agent (``inject/agent/``) imports none of it.
"""
