"""Target: an idle Python loop (the main thread wakes every 10 ms, so an injected bootstrap runs
within 10 ms, as in a real program between steps). Prints argv[1] (default `ready`), then runs
until killed."""
import sys
import time

print(sys.argv[1] if len(sys.argv) > 1 else "ready", flush=True)
while True:
    time.sleep(0.01)
