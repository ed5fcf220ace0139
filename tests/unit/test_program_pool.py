"""The daemon's pool of compiled BPF programs (bpf/shared.ProgramPool), with stand-in programs:
one compile per key however many attaches ask at once, a failed compile raises its own error
and releases the waiters, idle programs are capped, a discarded one closes with its last user."""

from __future__ import annotations

import threading

import pytest

from stacklens.bpf.shared import ProgramPool
from stacklens.errors import AttachError


class Prog:
    def __init__(self) -> None:
        self.users = 0
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_one_build_per_key_for_concurrent_attaches():
    pool, started, go, built = ProgramPool(), threading.Event(), threading.Event(), []

    def build():
        started.set()
        go.wait(10)
        built.append(Prog())
        return built[-1]

    got = []
    threads = [threading.Thread(target=lambda: got.append(pool.acquire(("k",), build))) for _ in range(4)]
    for t in threads:
        t.start()
    assert started.wait(10)
    go.set()
    for t in threads:
        t.join(10)
    assert len(built) == 1 and pool.compiles == 1
    assert len(got) == 4 and all(p is built[0] for p in got) and built[0].users == 4


def test_a_failed_build_raises_its_error_and_releases_the_waiters():
    pool, started, go = ProgramPool(), threading.Event(), threading.Event()
    calls, errors, waiter_got = [], [], []

    def failing():
        calls.append("fail")
        started.set()
        go.wait(10)
        raise AttachError("BPF compile failed: no kernel headers")

    def second():
        calls.append("ok")
        return Prog()

    def first_attach():
        try:
            pool.acquire(("k",), failing)
        except AttachError as e:
            errors.append(e)

    first = threading.Thread(target=first_attach)
    first.start()
    assert started.wait(10)
    waiter = threading.Thread(target=lambda: waiter_got.append(pool.acquire(("k",), second)))
    waiter.start()                         # waits for the first one's build
    go.set()
    first.join(10)
    waiter.join(10)
    assert not first.is_alive() and not waiter.is_alive()
    assert "no kernel headers" in str(errors[0])          # its own error, not a pool bug
    assert calls == ["fail", "ok"] and waiter_got[0].users == 1


def test_idle_programs_are_capped_and_a_discarded_one_closes_with_its_last_user():
    pool = ProgramPool(max_idle=1)
    a, b = pool.acquire(("a",), Prog), pool.acquire(("b",), Prog)
    pool.release(("a",), a)
    pool.release(("b",), b)                # two idle, cap one: the oldest closes
    assert a.closed and not b.closed
    assert pool.acquire(("b",), Prog) is b  # reused, not rebuilt
    c = pool.acquire(("c",), Prog)
    c2 = pool.acquire(("c",), Prog)
    assert c2 is c and c.users == 2
    pool.discard(("c",), c)                # one user gave up on it: no new attach gets it
    assert not c.closed and pool.acquire(("c",), Prog) is not c
    pool.release(("c",), c)                # the other one leaves: closed now
    assert c.closed
