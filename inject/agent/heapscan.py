"""The live instances of a class, found without holding any other object of the target, in a
walk whose pause is bounded.

``gc.get_referrers(cls)`` returns what refers to the class: its instances (a heap type's instances
visit their type) and a few long-lived containers. It walks every object the cyclic GC tracks, in
C, holding the GIL: the target's threads stop for as long as the walk takes, in proportion to the
heap, not to what it finds (benchmarks/bench_gc_referrers.py; docs/agent-in-target.md).

Where the heap is over MAX_SCAN_BLOCKS the walk is skipped and None returned: the caller says
what it could not find. The size is ``sys.getallocatedblocks()``, the interpreter's small-object
blocks (about 3.4 per GC-tracked object in a torch process), a sum over arenas that costs ~1/100
of the walk. The bound keeps a walk under ~1 M tracked objects.
"""

import gc
import sys

MAX_SCAN_BLOCKS = 3_000_000


def instances(classes, bounded=True):
    """The live instances of `classes` (a tuple of types: exact types, a subclass only if listed),
    or None where `bounded` and the heap is over MAX_SCAN_BLOCKS."""
    if bounded and sys.getallocatedblocks() > MAX_SCAN_BLOCKS:
        return None
    return [o for o in gc.get_referrers(*classes) if type(o) in classes]
