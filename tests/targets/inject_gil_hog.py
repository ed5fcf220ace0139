"""Target: runs Python (short sleeps) until a second thread appears, then keeps the GIL in long C
calls (``sum`` over a big range, ~2-3 s each, no eval-breaker check inside) until the stop file
exists. A pending call / PEP 768 request runs at once, so the bootstrap runs; the agent thread it
starts gets the GIL only between two C calls and cannot say hello within a short timeout: the
injector must report that the bootstrap ran, not that the target is not executing Python.
argv[1] = stop file."""
import os
import sys
import threading
import time

print("ready", flush=True)
while not os.path.exists(sys.argv[1]):
    if threading.active_count() > 1:
        sum(range(100_000_000))
    else:
        time.sleep(0.01)
print("done", flush=True)
