"""stacklens.records — the join's input vocabulary: BPF events (`events.py`) and the agent's
records (`agent.py`). The join, `bpf/` (which decodes ring records into events) and the agent
channel (which decodes messages into records) stand on it; it stands on `cct` (frames) only.
"""
