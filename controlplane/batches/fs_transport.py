"""kombu's filesystem transport (the embedded broker of `make run`), made safe for a consumer that polls while
producers write.

Stock kombu creates a message file, then writes it. A consumer listing the folder in between moves the empty
file away and fails to decode it; Celery's worker then stops for good, and every batch waits on a dead
worker. Here a message is written under a name the consumer ignores and renamed into place (atomic on POSIX), and
a message that still cannot be decoded (a file cut short by a crash) is dropped with an error in the log rather
than taking the worker down: item rows are the source of truth and the periodic sweep re-sends their work.

controlplane.celery registers this class for `filesystem://` URLs.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

log = logging.getLogger("controlplane.batches")
PARTIAL_SUFFIX = ".part"  # the consumer only takes names ending in ".<queue>.msg"


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        # Milliseconds first, so the consumer's sorted listing is first in, first out. Zero-padded (kombu's own
        # names are not): names sort as text, and "9999_…" would otherwise come after "10000_…".
        name = f"{round(time.monotonic() * 1000):015d}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = final + PARTIAL_SUFFIX
        try:
            with open(partial, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    def _get(self, queue: str) -> Any:
        while True:  # Empty (nothing left) ends it
            try:
                return super()._get(queue)
            except ValueError:
                log.error("dropped an unreadable message from queue %s; the sweep re-sends its work", queue)


class Transport(filesystem.Transport):
    Channel = Channel
