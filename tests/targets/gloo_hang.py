"""Target: a 2-rank torch.distributed job on CPU (gloo) where rank 0 enters a collective that
rank 1 never joins. Run under torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

Rank 0 starts a thread "spinner" (a busy loop that prints `progress N CPU_S WALL_S` every 0.2 s:
iterations, the thread's CPU seconds, monotonic seconds), prints `ready 0 PID`, then blocks in
all_reduce on the line marked COLLECTIVE. Rank 1 prints `ready 1 PID` and sleeps (never joins).
Both wait until killed (gloo's timeout is set to an hour).
"""

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist


def spin() -> None:
    n, last = 0, time.monotonic()
    while True:
        for _ in range(20_000):
            n += 1
        now = time.monotonic()
        if now - last >= 0.2:
            say(f"progress {n} {time.thread_time():.6f} {now:.6f}")
            last = now


def say(line: str) -> None:
    """One write per line: print() writes the text and its newline apart, and another thread's
    line could land between them (seen under two CPU hogs: `ready 0 PIDprogress …`)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=1))
    rank = dist.get_rank()
    if rank == 0:
        say(f"ready 0 {os.getpid()}")
        threading.Thread(target=spin, name="spinner", daemon=True).start()
        t = torch.ones(4)
        dist.all_reduce(t)  # COLLECTIVE
    else:
        say(f"ready 1 {os.getpid()}")
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main()
