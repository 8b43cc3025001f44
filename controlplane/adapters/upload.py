"""Adapter uploads are streamed to temporary files and cut off at HEARTH_LORA_MAX_BYTES.

Django's default handlers keep small files in memory and have no size limit; an adapter can be hundreds of
megabytes. `install(request)` must run before anything reads `request.POST` or `request.FILES`; the view then
checks the handler's `exceeded`, since Django stops parsing on `StopUpload` without raising. `local_copy` gives
the services any uploaded file (from this handler or Django's own) as a local file with its size and sha256.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.core.files.uploadedfile import TemporaryUploadedFile, UploadedFile
from django.core.files.uploadhandler import FileUploadHandler, StopUpload
from django.http import HttpRequest, QueryDict
from django.http.multipartparser import MultiPartParserError
from django.utils.datastructures import MultiValueDict

from controlplane.api import errors
from controlplane.api.errors import ApiError
from controlplane.api.http import ascii_int

# Room for the form's text fields (bounded by DATA_UPLOAD_MAX_MEMORY_SIZE) and the multipart part headers on top
# of the files themselves, when a Content-Length is judged before parsing.
_MULTIPART_OVERHEAD = 64 * 1024
CHUNK = 1024 * 1024


class LimitedUploadHandler(FileUploadHandler):
    """Every file part of the request goes to its own temporary file on disk; once the parts together pass
    `limit` bytes the upload stops (the partial file is deleted) and `exceeded` is set."""

    def __init__(self, request: HttpRequest, limit: int) -> None:
        super().__init__(request)
        self.limit = limit
        self.received = 0
        self.exceeded = False
        self.file: TemporaryUploadedFile | None = None

    def new_file(self, *args: Any, **kwargs: Any) -> None:
        super().new_file(*args, **kwargs)
        # Django's class: a NamedTemporaryFile in FILE_UPLOAD_TEMP_DIR, deleted when closed.
        self.file = TemporaryUploadedFile(self.file_name, self.content_type, 0, self.charset,
                                          self.content_type_extra)

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        self.received += len(raw_data)
        if self.received > self.limit:
            self.exceeded = True
            # connection_reset: do not read the rest of a body we are refusing anyway.
            raise StopUpload(connection_reset=True)
        assert self.file is not None
        self.file.write(raw_data)
        return None

    def file_complete(self, file_size: int) -> TemporaryUploadedFile | None:
        if self.file is None:
            return None
        self.file.seek(0)
        self.file.size = file_size
        return self.file

    def upload_interrupted(self) -> None:
        if self.file is not None:
            self.file.close()  # deletes the temporary file


def limit_bytes() -> int:
    return int(settings.HEARTH_LORA_MAX_BYTES)


def install(request: HttpRequest) -> LimitedUploadHandler:
    """Replace the request's upload handlers with the limited one (before the body is parsed)."""
    handler = LimitedUploadHandler(request, limit_bytes())
    request.upload_handlers = [handler]
    return handler


def too_large(limit: int) -> ApiError:
    return errors.request_too_large(f"The adapter's files are over the limit of {limit:,} bytes in total")


def check_content_length(request: HttpRequest) -> None:
    """413 before reading a body whose declared length cannot fit the limit (plus the form's own fields)."""
    length = ascii_int(request.headers.get("Content-Length"))
    slack = int(settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 0) + _MULTIPART_OVERHEAD
    if length is not None and length > limit_bytes() + slack:
        raise too_large(limit_bytes())


def read_form(request: HttpRequest, handler: LimitedUploadHandler) -> tuple[QueryDict, MultiValueDict]:
    """The multipart form's fields and files, parsed with the streaming handler in place (it takes the files);
    the parser's refusals and an upload cut off at the size limit as ApiErrors."""
    try:
        fields, files = request.POST, request.FILES
    except (RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent) as exc:
        raise errors.request_too_large(f"The form has too many or too large fields: {exc}") from None
    except MultiPartParserError as exc:
        raise errors.malformed(f"Malformed multipart body: {exc}") from None
    if handler.exceeded:
        raise too_large(handler.limit)
    return fields, files


@dataclass(frozen=True, slots=True)
class LocalFile:
    path: Path
    size: int
    sha256: str


def hash_into(chunks: Iterator[bytes], limit: int, out: Any = None) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise too_large(limit_bytes())
        digest.update(chunk)
        if out is not None:
            out.write(chunk)
    return size, digest.hexdigest()


def read_chunks(f: Any) -> Iterator[bytes]:
    return iter(lambda: f.read(CHUNK), b"")


@contextmanager
def local_copy(upload: UploadedFile, limit: int) -> Iterator[LocalFile]:
    """The upload as a file on local disk with its size and sha256 (the streaming handler's temporary file
    itself when there is one); 413 once it passes `limit` bytes."""
    if upload.size is not None and upload.size > limit:
        raise too_large(limit_bytes())
    if hasattr(upload, "temporary_file_path"):
        path = Path(upload.temporary_file_path())
        with path.open("rb") as f:
            size, sha = hash_into(read_chunks(f), limit)
        yield LocalFile(path, size, sha)
        return
    fd, name = tempfile.mkstemp(prefix="hearth-adapter-", dir=settings.FILE_UPLOAD_TEMP_DIR)
    try:
        with os.fdopen(fd, "wb") as out:
            size, sha = hash_into(iter(upload.chunks()), limit, out)
        yield LocalFile(Path(name), size, sha)
    finally:
        Path(name).unlink(missing_ok=True)
