"""Target: a launcher-like parent of processes that look like torch.distributed ranks by their
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), without torch.

    python fake_launcher.py JOBS NPROC

starts NPROC ranks for each of JOBS jobs (jobs told apart by MASTER_PORT 29500 + job); each rank
is a Python process that prints `ready JOB RANK PID` and sleeps until killed. The parent prints
`launcher PID` and waits for its children.
"""

import os
import subprocess
import sys

CHILD = ("import os, sys, time\n"
         "sys.stdout.write(f\"ready {os.environ['JOB']} {os.environ['RANK']} {os.getpid()}\\n\"); sys.stdout.flush()\n"
         "while True:\n"
         "    time.sleep(0.05)\n")


def main() -> None:
    jobs, nproc = int(sys.argv[1]), int(sys.argv[2])
    sys.stdout.write(f"launcher {os.getpid()}\n")
    sys.stdout.flush()
    kids = []
    for job in range(jobs):
        for rank in range(nproc):
            env = dict(os.environ, JOB=str(job), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                       LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + job))
            kids.append(subprocess.Popen([sys.executable, "-c", CHILD], env=env))
    for k in kids:
        k.wait()


if __name__ == "__main__":
    main()
