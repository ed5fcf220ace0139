"""`stacklens ps`, `stacklens advise` and `advise --job`: the daemon's answers as text or, with --json, as one JSON
document (`to_json`: every field of the gRPC message, NaN as null).

Talks to a running `stacklensd` over its Unix socket; no privilege of its own.
"""

from __future__ import annotations

import json
import math
import sys

from stacklens.cct.metrics import fmt_evidence
from stacklens.daemon.client import DaemonClient, ps_lines


def to_json(msg) -> dict:
    """A protobuf message as a JSON-ready dict: every field under its proto name (unset ones with
    their defaults), nested messages as dicts, an unset `optional` scalar and a NaN as null."""
    def value(v):
        if hasattr(v, "DESCRIPTOR"):
            return to_json(v)
        if isinstance(v, float) and math.isnan(v):
            return None
        return v

    out = {}
    for field in msg.DESCRIPTOR.fields:
        v = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[field.name] = {k: value(x) for k, x in v.items()}
        elif field.is_repeated:
            out[field.name] = [value(x) for x in v]
        elif field.message_type is None and field.has_presence and not msg.HasField(field.name):
            out[field.name] = None   # an `optional` scalar left unset: not measured, not 0
        else:
            out[field.name] = value(v)
    return out


def dump(doc) -> None:
    json.dump(doc, sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")


def run_ps(socket_path: str, *, as_json: bool = False) -> int:
    with DaemonClient(socket_path) as c:
        rows = c.processes()
    if as_json:
        dump({"processes": [to_json(p) for p in rows]})
    else:
        for line in ps_lines(rows):
            print(line)
    return 0


def run_advise(socket_path: str, pid: int, *, as_json: bool = False) -> int:
    with DaemonClient(socket_path) as c:
        findings = c.advice(pid)
    if as_json:
        dump({"pid": pid, "findings": [to_json(f) for f in findings]})
        return 0
    if not findings:
        print(f"no findings for {pid} (yet): the profile shows nothing the rules flag")
    for f in findings:
        print(f"[{f.severity}] {f.rule}: {f.title}")
        print("    at " + " → ".join(f.path[-4:]))
        for ev in f.evidence:
            print(f"    {ev.metric} = {fmt_evidence(ev.metric, ev.value)}")
        print(f"    fix: {f.fix}")
        if f.estimated_saving_share:
            print(f"    estimated saving: {100 * f.estimated_saving_share:.0f}%")
    return 0


def run_advise_job(socket_path: str, launcher: int, *, window_s: float, as_json: bool = False) -> int:
    """The straggler rule over the attached ranks of the job under `launcher`: each rank's last
    `window_s` seconds from the daemon, compared here (analyzer/job.py)."""
    from stacklens.analyzer.job import job_notes, stragglers
    from stacklens.errors import InputError, StacklensError

    if not (window_s > 0):
        raise InputError("--window must be > 0 seconds")
    snaps, notes = {}, []
    with DaemonClient(socket_path) as c:
        job = c.find_job(launcher)
        for r in job.ranks:
            try:
                snaps[r.rank] = c.snapshot(r.pid, window_s=window_s)
            except StacklensError as e:
                notes.append(f"rank {r.rank} (PID {r.pid}): {e}")
    findings = stragglers(snaps)
    notes += job_notes(snaps)
    if as_json:
        dump({"launcher": launcher, "job": job.job, "ranks": [to_json(r) for r in job.ranks],
              "findings": [{"rule": f.rule, "severity": f.severity, "path": list(f.path), "title": f.title,
                            "fix": f.fix, "estimated_saving_share": f.estimated_saving,
                            "evidence": f.evidence} for f in findings],
              "notes": notes})
        return 0
    print(f"job under {launcher} ({job.job}): {len(snaps)} of {len(job.ranks)} ranks compared over "
          f"the last {window_s:g}s")
    if not findings:
        print("no straggler: the ranks wait in collectives about alike")
    for f in findings:
        print(f"[{f.severity}] {f.rule}: {f.title}")
        print("    at " + " → ".join(f.path[-4:]))
        for k, v in f.evidence.items():
            print(f"    {k} = {fmt_evidence(k, v)}")
        print(f"    fix: {f.fix}")
        print(f"    estimated saving: {100 * f.estimated_saving:.0f}%")
    for n in notes:
        print(f"note: {n}")
    return 0
