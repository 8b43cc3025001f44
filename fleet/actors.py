"""Which replica an actor id was, for every replica a router in this process has seen.

Ray names a dead replica in some errors (an ActorDiedError's message carries the actor's name) but gives only its
actor id in others (ActorUnavailableError). The client's retry must know which replica to avoid either way, and
the router, which runs in the client's process, is what sees both. Module-level functions on purpose: Serve
pickles the router class by value, and a function imported from here pickles by reference, so the router and the
client share this one table. Bounded; a dead replica's entry stays a while, since a death is when it is asked
for.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

LIMIT = 4096
_labels: OrderedDict[str, str] = OrderedDict()
_lock = threading.Lock()  # Serve's router loop writes, request threads read


def note_actor(actor_id: str, label: str) -> None:
    with _lock:
        if _labels.get(actor_id) == label:
            return
        _labels[actor_id] = label
        while len(_labels) > LIMIT:
            _labels.popitem(last=False)


def actor_label(actor_id: str) -> str:
    """The replica label of an actor id; "" for one no router here has seen."""
    with _lock:
        return _labels.get(actor_id, "")
