"""The dashboard's LoRA adapters page: the adapters an account can use (its own and public ones), upload and delete.

Everything goes through `controlplane.adapters.services`, the functions the REST API calls, so the page cannot
accept an adapter the API would refuse. The page's script posts the upload with XMLHttpRequest (the only browser
API that reports upload progress) and deletes with fetch(); both ask for JSON and get the re-rendered list back,
so rows are formatted by one template. A refusal is a 4xx `{"error": {"message", "param", "code"}}`. Without
JavaScript the same form posts normally and the page comes back with the message next to the form.

Uploads and deletes are the owners' (and operators'), as with API keys; members only look.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.files.uploadedfile import UploadedFile
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.urls import path
from django.views.decorators.csrf import csrf_exempt, csrf_protect
from django.views.decorators.http import require_http_methods

from controlplane.accounts.models import Account
from controlplane.accounts.services import user_can_access
from controlplane.adapters import services, upload
from controlplane.api import errors
from controlplane.api.errors import ApiError
from controlplane.api.http import json_response
from controlplane.catalog.services import ModelEntry, catalog
from controlplane.dashboard.access import account_or_404
from controlplane.serving.playground import error_response
from inference.lora.format import CONFIG_FILE, WEIGHTS_FILE
from inference.models.catalog import DEFAULT_MODEL

# The form's file inputs and the adapter file each one carries: the user's own file names do not matter.
FILE_INPUTS = {"config": CONFIG_FILE, "weights": WEIGHTS_FILE}
FORM_FIELDS = ("action", "name", "base_model", "description")
OWNERS_ONLY = "Only the account's owners can upload and delete its adapters."


def lora_models() -> list[ModelEntry]:
    """The base models an adapter can be uploaded for: installed catalog models that serve LoRA."""
    return sorted((e for e in catalog().values() if e.supports_lora and e.installed), key=lambda e: e.name)


def _wants_json(request: HttpRequest) -> bool:
    return "application/json" in request.headers.get("Accept", "")


def _context(request: HttpRequest, account: Account, **extra: Any) -> dict[str, Any]:
    return {"account": account, "page": "adapters", "adapters": list(services.visible_adapters(account.pk)),
            "manage": user_can_access(request.user, account.pk, manage=True), **extra}


def _render(request: HttpRequest, account: Account, accounts: list[Account], *, status: int = 200,
            form: dict[str, str] | None = None, **extra: Any) -> HttpResponse:
    models = lora_models()
    names = [m.name for m in models]
    base = DEFAULT_MODEL if DEFAULT_MODEL in names else (names[0] if names else "")
    values = {"name": "", "description": "", "base_model": base, **(form or {})}
    return render(request, "dashboard/adapters.html", _context(
        request, account, accounts=accounts, base_models=models, form=values,
        description_max=services.DESCRIPTION_MAX_CHARS, **extra), status=status)


def _answer(request: HttpRequest, account: Account, result: dict[str, Any], notice: str, status: int) -> HttpResponse:
    """A done action: JSON with the fresh list for the page's script, else back to the page (post/redirect/get)."""
    if _wants_json(request):
        listing = render_to_string("dashboard/adapters/list.html", _context(request, account), request=request)
        return json_response({**result, "list": listing}, status=status)
    messages.success(request, notice)
    return redirect("dashboard-adapters", account_id=account.pk)


def _read_form(request: HttpRequest, handler: upload.LimitedUploadHandler) -> dict[str, str]:
    """The form's text fields (the streaming handler takes the files)."""
    post, _ = upload.read_form(request, handler)
    return {name: post.get(name, "") for name in FORM_FIELDS}


def _files(request: HttpRequest) -> dict[str, UploadedFile]:
    """The chosen files under their adapter file names. A file must be of its input's type: the `accept`
    attribute is only a hint to the browser, and a pickled `.bin` must not pass for the safetensors weights."""
    files = {}
    for field, file_name in FILE_INPUTS.items():
        chosen = request.FILES.get(field)
        if chosen is None:
            continue
        suffix = PurePosixPath(file_name).suffix
        if not (chosen.name or "").lower().endswith(suffix):
            raise errors.invalid(f"{file_name}: choose a {suffix} file, not {chosen.name!r}", field)
        files[file_name] = chosen
    return files


@csrf_protect
def _post(request: HttpRequest, account: Account, form: dict[str, str]) -> HttpResponse:
    """An upload or a delete; the CSRF check runs on entry, on the form `page` has already parsed."""
    if not user_can_access(request.user, account.pk, manage=True):
        raise errors.forbidden(OWNERS_ONLY)
    if form["action"] == "delete":
        adapter_id = request.POST.get("adapter_id", "")
        services.delete_adapter(account.pk, adapter_id)
        return _answer(request, account, {"deleted": adapter_id}, "Adapter deleted.", 200)
    if form["action"] != "upload":
        raise errors.invalid(f"Unknown action {form['action']!r}", "action")
    adapter = services.upload_adapter(account, name=form["name"], base_model=form["base_model"],
                                      description=form["description"], files=_files(request))
    return _answer(request, account, {"adapter": services.as_dict(adapter)},
                   f"Adapter {adapter.name} uploaded.", 201)


@csrf_exempt  # only the wrapper: the CSRF check reads the body, which must wait for the streaming upload handler
@login_required
@require_http_methods(["GET", "POST"])
def page(request: HttpRequest, account_id: str) -> HttpResponse:
    account, accounts = account_or_404(request, account_id)
    if request.method == "GET":
        return _render(request, account, accounts)
    handler = upload.install(request)
    form: dict[str, str] = {}
    try:
        upload.check_content_length(request)
        form = _read_form(request, handler)
        return _post(request, account, form)
    except ApiError as exc:
        if _wants_json(request):
            return error_response(exc)
        where = "error" if form.get("action") == "delete" else "upload_error"
        return _render(request, account, accounts, status=exc.status, form=form, **{where: exc.message})


urlpatterns = [
    path("<str:account_id>/adapters/", page, name="dashboard-adapters"),
]
