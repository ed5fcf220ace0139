"""Target: an idle Python loop (the main thread wakes every 10 ms, so an injected bootstrap runs
within 10 ms, as in a real program between steps). Prints `ready`; runs until killed."""
import time

print("ready", flush=True)
while True:
    time.sleep(0.01)
