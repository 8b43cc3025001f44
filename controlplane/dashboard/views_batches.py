"""The dashboard's Batches page: the account's batches, newest first, with progress that moves live (batches.js
listens on ws/dashboard/<account>/batches, see batch_consumers.py), cancel, and downloads of results.

Everything goes through controlplane.batches.services and file_services, the same functions the OpenAI and Workers
AI batch routes call, so the page can never show or do something the API would not."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import path, reverse
from django.utils.cache import patch_vary_headers
from django.views.decorators.http import require_GET, require_POST

from controlplane.accounts.models import Account
from controlplane.api import errors
from controlplane.api.errors import ApiError
from controlplane.api.http import dumps, envelope
from controlplane.batches import file_services, results, services
from controlplane.batches.events import STATUS_RANK
from controlplane.batches.models import Batch
from controlplane.dashboard.access import account_or_404

PAGE_SIZE = 25
Status = Batch.Status
# services.cancel_batch accepts these; the button is offered only for them.
CANCELLABLE = (Status.VALIDATING, Status.IN_PROGRESS)
DOWNLOAD_LABELS = {"output": "Output", "errors": "Errors", "results": "Results"}


@dataclass(frozen=True, slots=True)
class Row:
    """A batch as one line of the table: its progress bar and what can be done with it."""

    batch: Batch
    finished: int
    percent: int  # rounded down, so 100% means every request has finished
    widths: dict[str, str]  # bar segment -> CSS width, as a plain decimal whatever the locale
    cancellable: bool
    downloads: tuple[tuple[str, str], ...]  # (kind, label)


def _width(count: int, total: int) -> str:
    return f"{100 * count / total:.2f}%" if total else "0%"


def _downloads(batch: Batch) -> tuple[tuple[str, str], ...]:
    if batch.api == Batch.Api.OPENAI:
        kinds = [k for k, present in (("output", batch.output_file_id), ("errors", batch.error_file_id)) if present]
    else:
        done = batch.status in Batch.TERMINAL and batch.results_purged_at is None
        kinds = ["results"] if done else []
    return tuple((k, DOWNLOAD_LABELS[k]) for k in kinds)


def row_of(batch: Batch) -> Row:
    total = batch.total_count
    finished = batch.completed_count + batch.failed_count + batch.cancelled_count
    return Row(batch=batch, finished=finished, percent=100 * finished // total if total else 0,
               widths={"completed": _width(batch.completed_count, total), "failed": _width(batch.failed_count, total),
                       "cancelled": _width(batch.cancelled_count, total)},
               cancellable=batch.status in CANCELLABLE, downloads=_downloads(batch))


def _listing(account: Account, after: str | None) -> tuple[list[Row], str | None, str | None]:
    """A page of rows, the cursor of the next (older) page if there is one, and an error for a bad cursor (the
    newest page is shown instead)."""
    try:
        batches, more = services.list_batches(account.pk, limit=PAGE_SIZE, after=after)
        error = None
    except ApiError:
        batches, more = services.list_batches(account.pk, limit=PAGE_SIZE, after=None)
        error = f"There is no batch {after} in this account to list older batches from; showing the newest."
    return [row_of(b) for b in batches], batches[-1].pk if more and batches else None, error


def _render(request: HttpRequest, account: Account, accounts: list[Account], *, after: str | None,
            error: str | None = None, notice: str | None = None, status: int = 200) -> HttpResponse:
    rows, older, cursor_error = _listing(account, after)
    if cursor_error is not None:  # an error of the action itself says more than the cursor's
        after, error, status = None, error or cursor_error, status if error else 400
    context = {"account": account, "accounts": accounts, "page": "batches", "rows": rows, "after": after,
               "older": older, "error": error, "notice": notice,
               "statuses": {"labels": dict(Status.choices), "rank": STATUS_RANK}}
    # htmx (cancel) and the page's own re-reads ask for the list alone; the message goes out of band.
    fragment = request.headers.get("HX-Request") == "true"
    template = "dashboard/batches/fragment.html" if fragment else "dashboard/batches.html"
    response = render(request, template, context, status=status)
    patch_vary_headers(response, ["HX-Request"])
    return response


@login_required
@require_GET
def page(request: HttpRequest, account_id: str) -> HttpResponse:
    account, accounts = account_or_404(request, account_id)
    return _render(request, account, accounts, after=request.GET.get("after") or None)


@login_required
@require_POST
def cancel(request: HttpRequest, account_id: str, batch_id: str) -> HttpResponse:
    """Any member of the account (and operators) may cancel: a batch is the account's work, not one person's."""
    account, accounts = account_or_404(request, account_id)
    after = request.POST.get("after") or None
    try:
        batch = services.cancel_batch(account.pk, batch_id)
    except ApiError as exc:
        message = exc.message if exc.status == 404 else f"{exc.message} ({batch_id})."
        return _render(request, account, accounts, after=after, error=message, status=exc.status)
    notice = (f"{batch.pk} is {batch.get_status_display().lower()}: requests that had not started will not run; "
              "answers already made stay in its results.")
    if request.headers.get("HX-Request") == "true":
        return _render(request, account, accounts, after=after, notice=notice)
    messages.success(request, notice)
    url = reverse("dashboard-batches", args=[account.pk])
    return redirect(f"{url}?{urlencode({'after': after})}" if after else url)


@login_required
@require_GET
def download(request: HttpRequest, account_id: str, batch_id: str, kind: str) -> HttpResponse:
    account, accounts = account_or_404(request, account_id)
    try:
        filename, content, content_type = _result(account.pk, batch_id, kind)
    except ApiError as exc:
        return _render(request, account, accounts, after=None, error=exc.message, status=exc.status)
    response = HttpResponse(content, content_type=content_type)
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def _result(account_id: str, batch_id: str, kind: str) -> tuple[str, bytes, str]:
    """The download: an OpenAI batch's output or error file (as GET /v1/files/{id}/content serves it), or a Workers
    AI batch's answer (as its poll returns it once finished)."""
    batch = services.get_batch(account_id, batch_id)
    openai = batch.api == Batch.Api.OPENAI
    if kind not in DOWNLOAD_LABELS or openai != (kind != "results"):
        raise errors.not_found(f"{batch_id} has no {kind} to download")
    if batch.status not in Batch.TERMINAL:
        raise ApiError(409, errors.CODE_INVALID_INPUT, f"{batch_id} is {batch.get_status_display().lower()}: its "
                       "results can be downloaded once it has finished", openai_code="invalid_state")
    if openai:
        file_id = batch.output_file_id if kind == "output" else batch.error_file_id
        if file_id is None:
            raise errors.not_found(f"{batch_id} has no {kind} file" + (
                "" if batch.results_purged_at is None else ": it was removed after the retention period"))
        found, content = file_services.file_content(account_id, file_id)
        return found.filename, content, "application/jsonl"
    if batch.results_purged_at is not None:
        raise errors.not_found(f"The results of {batch_id} were removed after the retention period")
    body = envelope(results.native_result(batch, services.items_of(batch)))
    return f"{batch.pk}.json", dumps(body).encode(), "application/json"


urlpatterns = [
    path("<str:account_id>/batches/", page, name="dashboard-batches"),
    path("<str:account_id>/batches/<str:batch_id>/cancel/", cancel, name="dashboard-batch-cancel"),
    path("<str:account_id>/batches/<str:batch_id>/download/<str:kind>/", download, name="dashboard-batch-download"),
]
