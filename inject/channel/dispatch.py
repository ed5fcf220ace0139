"""One agent message to records: the decoder that owns its kind, and what a rejection counts.

No privilege; a decoder may read the target's memory through the connection's reader (buffers
left in place, ``gpu/cupti.py``). GPU messages go to the decoder of the vendor declaring their
kind (``gpu.route``: ``VENDORS[...].decoder.decode``), the rest to ``messages.parse_message``.
Whatever a decoder raises on hostile input is a rejection, counted by kind (``rejected_message``,
``rejected_message:KIND``, unknown kinds as ``other``), and the connection goes on.
"""

from __future__ import annotations

import collections

from stacklens.inject.channel.gpu import Connection, route
from stacklens.inject.channel.messages import KNOWN_KINDS, parse_message
from stacklens.inject.channel.validate import ProtocolError

RAW_KIND = "cupti_raw"      # the kind of a raw frame (wire.RAW_MAGIC): CUPTI's buffers, the only ones so far


def decode(kind, msg, n: int, link: Connection, stats: collections.Counter) -> tuple[list, int]:
    """The records of one message (a raw frame: its bytes; ``n``: its length) and their estimated
    bytes beyond the records themselves; ``([], 0)`` for a rejected one. The decoders' counters
    (``link.counts``) are added to ``stats`` either way."""
    counts = collections.Counter()
    try:
        vendor = route(kind, link)
        if vendor is not None:
            recs = vendor.decoder.decode(kind, msg, link)
        else:
            recs = parse_message(msg, counts, link)
    except (ProtocolError, TypeError, IndexError, KeyError, RecursionError):
        reject(kind, stats)
        return [], 0
    finally:
        for k, v in link.counts.items():
            if v and k != "bytes":
                stats[k] += v
        decoded = link.counts.pop("bytes", None)
        link.counts.clear()
    if counts["truncated_strings"]:
        stats["truncated_strings"] += counts["truncated_strings"]
    # estimated bytes beyond the records: a decoder's own estimate (buffers: their names), else
    # the message's length and its frames'
    return recs, decoded if decoded is not None else n + counts["bytes"]


def reject(kind, stats: collections.Counter) -> None:
    stats["rejected_message"] += 1
    stats["rejected_message:" + (kind if kind in KNOWN_KINDS else "other")] += 1


__all__ = ["RAW_KIND", "decode", "reject"]
