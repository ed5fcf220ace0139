"""Hotspot series over successive scrapes (daemon/prom.py HotspotTracker): a context near the
boundary does not flap, a clearly hotter newcomer enters, a displaced context does not come back
under the churn that displaced it (only when it grows far faster), counters never decrease and add
up to the total; the `line` label relative to site-packages or the target's directory; the context without
its native leaf; stacklens_build_info."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from stacklens.cct import CCT, Frame
from stacklens.daemon.join.joiner import DAEMON_METRICS
from stacklens.daemon.prom import (MARGIN, OTHER, RETURN_BAR, HotspotTracker, Source, StacklensCollector, hotspot_context,
                                   line_label, short_path)


def names(series):
    return {c for c, _, _ in series if c != OTHER}


def test_boundary_context_does_not_flap_and_a_clear_newcomer_enters():
    tr = HotspotTracker()
    cum = {("a", "l"): 100, ("b", "l"): 50, ("c", "l"): 40}
    assert names(tr.update(cum, k=2)) == {"a", "b"}
    seen = []
    for i in range(20):   # c grows a little faster than b, alternately: within the margin
        cum = {("a", "l"): cum[("a", "l")] + 10, ("b", "l"): cum[("b", "l")] + (5 if i % 2 else 6),
               ("c", "l"): cum[("c", "l")] + (6 if i % 2 else 5)}
        seen.append(names(tr.update(cum, k=2)))
    assert all(s == {"a", "b"} for s in seen)
    # c now grows far faster than b: past the margin it enters (room up to 2k: b stays)
    for _ in range(10):
        cum = {("a", "l"): cum[("a", "l")] + 10, ("b", "l"): cum[("b", "l")] + 5, ("c", "l"): cum[("c", "l")] + 30}
        got = names(tr.update(cum, k=2))
    assert got == {"a", "b", "c"}
    assert tr.score[("c", "l")] > tr.score[("b", "l")] * (1 + MARGIN)


def test_exported_context_leaves_for_a_clearly_stronger_one_and_the_set_stays_bounded():
    tr = HotspotTracker()
    cum = {(f"c{i}", "l"): 100 - i for i in range(10)}
    assert names(tr.update(cum, k=2)) == {"c0", "c1"}
    for step in range(1, 30):   # c2..c9 grow fast in turn; c0 and c1 stop
        cum = dict(cum)
        for i in range(2, 10):
            cum[(f"c{i}", "l")] += 50 * step
        series = tr.update(cum, k=2)
        assert len(names(series)) <= 4
    assert not names(series) & {"c0", "c1"}     # displaced by newcomers past the margin


def test_series_are_counters_that_add_up_to_the_total():
    tr = HotspotTracker()
    cum = {("a", "l"): 10, ("b", "l"): 5, ("c", "l"): 1}
    last: dict[str, float] = {}
    ended = 0.0     # a series that ends keeps its last value (Prometheus marks it stale)
    for step in range(30):
        cum = {("a", "l"): cum[("a", "l")] + (1 if step > 10 else 8), ("b", "l"): cum[("b", "l")] + 2,
               ("c", "l"): cum[("c", "l")] + (12 if step > 10 else 0)}
        series = tr.update(cum, k=1)
        now = {c: v for c, _, v in series}
        for c, v in now.items():
            assert v >= last.get(c, 0) or c not in last    # a series that stays never decreases
        if OTHER in last:
            assert now[OTHER] >= last[OTHER]
        ended += sum(v for c, v in last.items() if c not in now)
        assert sum(now.values()) + ended == pytest.approx(sum(cum.values()))
        last = now
    assert "c" in now   # the newcomer that outgrew the rest got in


class Scrapes:
    """Feeds a tracker and checks every scrape: counters never decrease, every series (an ended one
    at its last value) plus [other] add up to the total exactly; records each context's presence."""

    def __init__(self, k: int) -> None:
        self.tr, self.k = HotspotTracker(), k
        self.last: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        self.history: list[set[str]] = []

    def scrape(self, cum: dict[tuple[str, str], int]) -> set[str]:
        now = {c: v for c, _, v in self.tr.update(cum, k=self.k)}
        for c, v in now.items():
            assert v >= self.last.get(c, 0) and v >= self.ended.get(c, 0)   # a counter, even one back
        self.ended.update({c: v for c, v in self.last.items() if c not in now})
        shown = {**self.ended, **now}
        assert sum(shown.values()) == pytest.approx(sum(cum.values()), abs=1e-9)
        assert len(names_of(now.items())) <= 2 * self.k
        self.last = now
        self.history.append(names_of(now.items()))
        return self.history[-1]

    def returns(self) -> set[str]:
        """Contexts that were a series, were not, and were again."""
        out, gone = set(), set()
        for before, after in zip(self.history, self.history[1:]):
            out |= after & gone
            gone |= before - after
        return out


def names_of(series):
    return {c for c, _ in series if c != OTHER}


def test_displaced_steady_context_does_not_come_back_past_a_stopped_one():
    """The pattern of the 10-minute scrape (2 series came back): a warm-up context stops with a
    total above small steady ones; a newcomer takes a slot; had the smallest total left (s2), it
    would overtake the stopped one later and come back. The stopped one leaves instead."""
    sc = Scrapes(k=2)
    cum = {("s1", "l"): 5, ("s2", "l"): 4}
    sc.scrape(dict(cum))                                 # s1, s2: the first two, while there is room
    for t in range(1, 250):
        cum[("s1", "l")] += 3
        cum[("s2", "l")] += 2
        cum[("warm", "l")] = cum.get(("warm", "l"), 0) + (50 if t <= 6 else 0)    # stops at 300
        cum[("big", "l")] = cum.get(("big", "l"), 0) + 20
        if t >= 20:
            cum[("new", "l")] = cum.get(("new", "l"), 0) + 8
        sc.scrape(dict(cum))
    assert {"s1", "s2", "warm", "big"} in sc.history          # the set was full before `new` came
    assert not sc.returns()
    assert sc.history[-1] == {"s1", "s2", "big", "new"}        # the stopped one left for the newcomer


def test_no_series_comes_back_under_random_churn_and_accounting_is_exact():
    """Many small contexts of near-equal pace (sampled, so totals jitter), warm-up ones that stop,
    late ones that start: no context is a series twice; [other] plus the series is the total."""
    for seed in range(8):
        rng = random.Random(seed)
        pace = {f"s{i}": 40 / (i + 1) for i in range(40)}
        pace.update({f"w{i}": rng.uniform(1, 8) for i in range(10)})
        start = {c: (rng.randrange(10, 80) if c.startswith("l") else 0) for c in pace}
        pace.update({f"l{i}": rng.uniform(0.5, 4) for i in range(6)})
        start.update({f"l{i}": rng.randrange(10, 80) for i in range(6)})
        sc = Scrapes(k=8)
        cum: dict[tuple[str, str], int] = {}
        for step in range(120):
            for c, p in pace.items():
                live = step >= start.get(c, 0) and not (c.startswith("w") and step > 8)
                if live:
                    cum[(c, "l")] = cum.get((c, "l"), 0) + max(0, round(rng.gauss(p, p ** 0.5)))
            sc.scrape(dict(cum))
        assert not sc.returns(), (seed, sc.returns())
        best = sum(sorted(cum.values())[-16:])     # the 2k largest totals, had they been known from the start
        assert sc.tr.other / sum(cum.values()) <= 1 - best / sum(cum.values()) + 0.04


def test_a_displaced_context_comes_back_only_when_it_grows_far_faster():
    sc = Scrapes(k=1)
    cum = {("a", "l"): 0, ("b", "l"): 0, ("c", "l"): 0}
    for step in range(30):     # c enters early, then b and a outgrow it and c leaves
        cum = {("a", "l"): cum[("a", "l")] + 10, ("b", "l"): cum[("b", "l")] + (8 if step > 3 else 0),
               ("c", "l"): cum[("c", "l")] + (30 if step < 2 else 1)}
        sc.scrape(dict(cum))
    assert sc.history[1] >= {"c"} and sc.history[-1] == {"a", "b"}
    times, left_at, value = sc.tr.left[("c", "l")]
    assert times == 1
    for _ in range(60):        # c now grows a little faster than b: not enough to come back
        cum = {("a", "l"): cum[("a", "l")] + 10, ("b", "l"): cum[("b", "l")] + 8, ("c", "l"): cum[("c", "l")] + 12}
        assert "c" not in sc.scrape(dict(cum))
    for _ in range(200):       # a later phase: c is the hotspot by far
        cum = {("a", "l"): cum[("a", "l")] + 10, ("b", "l"): cum[("b", "l")] + 8, ("c", "l"): cum[("c", "l")] + 400}
        if "c" in sc.scrape(dict(cum)):
            break
    assert "c" in sc.history[-1]
    # past the bar over the weakest exported (b, which left for it as the one that grew least)
    assert cum[("c", "l")] - left_at > sc.tr.score[("b", "l")] * (1 + MARGIN) * RETURN_BAR
    assert sc.history[-1] == {"a", "c"} and sc.tr.exported[("c", "l")] == value + 400   # resumed


def test_line_label_relative_and_bounded():
    sp = "/opt/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py"
    assert short_path(sp) == "site-packages/torch/nn/modules/linear.py"
    assert short_path("/srv/app/train.py", ["/srv/app"]) == "train.py"
    assert short_path("/srv/app/train.py") == "app/train.py"
    assert short_path("<string>") == "<string>"
    assert line_label((Frame.python(sp, "forward", 125),)) == "site-packages/torch/nn/modules/linear.py:125"
    long = line_label((Frame.python("/x/" + "d" * 300 + "/m.py", "f", 7),))
    assert len(long) <= 80 and long.endswith("/m.py:7") and long.startswith("…")


def test_context_drops_the_native_leaf_under_python_or_an_operator():
    path = (Frame.python("/srv/m.py", "forward", 17), Frame.op("aten::mm"), Frame.native("libtorch_cpu.so", "sgemm_k"))
    assert hotspot_context(path) == "m.py:forward:17 > aten::mm"
    assert hotspot_context((Frame.native("libc.so.6", "memcpy"),)) == "native:libc.so.6:memcpy"


def test_collector_keeps_series_across_scrapes_and_exports_build_info():
    t = CCT(metrics=DAEMON_METRICS, max_nodes=None)
    snaps = []
    for step in range(6):
        for i in range(6):   # six contexts of near-equal growth: the ranking among them shuffles
            t.add_many((Frame.python("/srv/train.py", f"f{i}", i),), {"cpu_samples": 10 + (i + step) % 3})
        snaps.append(t.snapshot(meta={"script": "/srv/train.py"}))
    current = [snaps[0]]
    reg = CollectorRegistry()
    reg.register(StacklensCollector(lambda: [Source(7, "py", "", current[0], {}, cpu_hz=100)], top_k=3, hotspots=True))
    exported = []
    for s in snaps:
        current[0] = s
        text = generate_latest(reg).decode()
        exported.append({l.split('context="', 1)[1].split('"', 1)[0] for l in text.splitlines()
                         if l.startswith("stacklens_hotspot_cpu_seconds_total{")})
    assert all(e == exported[0] for e in exported) and len(exported[0]) == 4
    assert 'line="train.py:' in text and "srv/" not in text   # relative to the script's directory
    assert reg.get_sample_value("stacklens_build_info", {"version": __import__("stacklens").__version__,
                                                         "python": __import__("platform").python_version(),
                                                         "bcc": __import__("stacklens.daemon.prom", fromlist=["x"])
                                                         .build_labels()["bcc"]}) == 1


def test_context_names_the_operator_the_python_line_called():
    path = (Frame.python("/srv/m.py", "loss", 9), Frame.op("aten::mse_loss"), Frame.op("aten::empty_memory_format"),
            Frame.native("libtorch_cpu.so", "malloc"))
    assert hotspot_context(path) == "m.py:loss:9 > aten::mse_loss"
    assert hotspot_context((Frame.op("aten::mm"), Frame.op("aten::addmm_"))) == "aten::mm"
