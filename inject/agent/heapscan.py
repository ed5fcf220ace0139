"""The live instances of a class, found without holding any other object of the target, in a
walk that is never longer than MAX_SCAN_BLOCKS allows.

``gc.get_referrers(cls)`` returns what refers to the class: its instances (a heap type's instances
visit their type) and a few long-lived containers. It walks every object the cyclic GC tracks, in
C, holding the GIL: the target's threads stop for as long as the walk takes, in proportion to the
heap, not to what it finds (benchmarks/bench_gc_referrers.py; docs/agent-in-target.md: ~25-55 ms
per million tracked objects on the 2-vCPU VM).

Where the heap is over MAX_SCAN_BLOCKS the walk is not made and None is returned: the caller says
what it could not find. The size is ``sys.getallocatedblocks()``, the interpreter's small-object
blocks (about 3 per GC-tracked object), a sum over arenas that costs ~1/200 of the walk. The
bound stops a walk of more than ~10 M tracked objects (a pause of the order of a second). It is
for the outliers: torch 2.13 and JAX imported, with a model and a jitted step, held 0.88 M blocks
(0.24 M tracked objects, a 17 ms walk), this project's test suite late in its run over 3 M. A
lower bound would lose what the walks are for in ordinary jobs (the executables a JAX job compiled
before the attach); callers that walk again bound how often instead (inductor.py).
"""

import gc
import sys

MAX_SCAN_BLOCKS = 30_000_000


def instances(classes):
    """The live instances of `classes` (a tuple of types: exact types, a subclass only if listed),
    or None where the heap is over MAX_SCAN_BLOCKS."""
    if sys.getallocatedblocks() > MAX_SCAN_BLOCKS:
        return None
    return [o for o in gc.get_referrers(*classes) if type(o) in classes]
