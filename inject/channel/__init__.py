"""The agent channel, daemon side: what the injected agent sends, received and decoded.

``server.py`` (the socket per target, its reader thread and bounded queue), ``agentdir.py`` (the
agent directories, their locks, the stale-file sweep), ``messages.py`` (JSON messages -> records),
``validate.py`` (the strict checks), ``inductor.py`` (torch.compile's generated modules) and
``gpu/`` (the GPU vendors: their declaration, ``VENDORS``, and one decoder each, which owns its
transport). Runs in the daemon; the agent (``inject/agent/``) imports none of it.
"""
