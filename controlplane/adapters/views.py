"""LoRA adapter routes, Workers AI style (/client/v4/accounts/{id}/ai/finetunes...). Views parse and delegate
to services.

An API key (or a signed-in member) of the account: reading needs `read`, creating, uploading and deleting need
`admin` (they manage the account). Multipart bodies are streamed to temporary files by our own upload handler,
installed before anything reads the body, and cut off at HEARTH_LORA_MAX_BYTES (413 / 3006).
"""

from __future__ import annotations

from django.core.exceptions import RequestDataTooBig, TooManyFilesSent
from django.core.files.uploadedfile import UploadedFile
from django.http import HttpRequest, HttpResponse
from django.http.multipartparser import MultiPartParserError
from django.utils.datastructures import MultiValueDict

from controlplane.accounts.models import Account, ApiKey
from controlplane.adapters import services, upload
from controlplane.adapters.schemas import FinetuneCreate
from controlplane.api import errors
from controlplane.api.auth import Principal, principal
from controlplane.api.body import parse
from controlplane.api.http import api_view, envelope, json_response, read_json

# Plain strings: the permission check quotes them in its message.
READ, ADMIN = ApiKey.Permission.READ.value, ApiKey.Permission.ADMIN.value




def _is_multipart(request: HttpRequest) -> bool:
    return (request.content_type or "").startswith("multipart/form-data")


def _who(request: HttpRequest, account_id: str, permission: str,
         handler: upload.LimitedUploadHandler | None = None) -> Principal:
    try:
        who = principal(request)  # for a signed-in user's write this reads the form (CSRF token)
    except (RequestDataTooBig, TooManyFilesSent) as exc:
        raise errors.request_too_large(f"The form is too large: {exc}") from None
    except MultiPartParserError as exc:
        raise errors.malformed(f"Malformed multipart body: {exc}") from None
    except errors.ApiError:
        if handler is not None and handler.exceeded:  # the cut-off upload also lost the CSRF token
            raise upload.too_large(handler.limit) from None
        raise
    who.require(account_id, permission)
    return who


def _account(account_id: str) -> Account:
    account = Account.objects.filter(pk=account_id).first()
    if account is None:
        raise errors.not_found(f"No such account: {account_id}")
    return account


def _check_scope(who: Principal, model: object) -> None:
    if who.key is not None and isinstance(model, str) and not who.key.may_use(model):
        raise errors.forbidden(f"This API key may not use the model {model}")


def _form(request: HttpRequest, handler: upload.LimitedUploadHandler) -> tuple[dict[str, str], MultiValueDict]:
    """The multipart form's fields and files, after the streaming handler has taken the files."""
    upload.check_content_length(request)  # after authentication, like every other body error
    fields, files = upload.read_form(request, handler)
    return {k: fields.get(k, "") for k in fields}, files


def _start_upload(request: HttpRequest) -> upload.LimitedUploadHandler | None:
    if request.method != "POST" or not _is_multipart(request):
        return None
    return upload.install(request)  # before principal(): a session's CSRF check reads the form


@api_view("native", ("GET", "POST"))
def finetunes(request: HttpRequest, account_id: str) -> HttpResponse:
    """GET: the account's adapters and the published ones. POST JSON {name, model, description}: a new adapter
    whose files follow at .../finetune-assets; POST multipart (name, model, description and both files): a ready
    adapter in one request."""
    if request.method == "GET":
        _who(request, account_id, READ)
        rows = [services.as_dict(a) for a in services.visible_adapters(account_id)]
        info = {"page": 1, "per_page": len(rows), "count": len(rows), "total_count": len(rows)}
        return json_response(envelope(rows, result_info=info))
    handler = _start_upload(request)
    who = _who(request, account_id, ADMIN, handler)
    account = _account(account_id)
    if handler is None:
        body = parse(FinetuneCreate, read_json(request))
        _check_scope(who, body.model)
        adapter = services.create_adapter(account, name=body.name, base_model=body.model,
                                          description=body.description)
        return json_response(envelope(services.as_dict(adapter)))
    fields, files = _form(request, handler)
    _check_scope(who, fields.get("model"))
    adapter = services.upload_adapter(account, name=fields.get("name", ""), base_model=fields.get("model", ""),
                                      description=fields.get("description", ""), files=_named_files(files))
    return json_response(envelope(services.as_dict(adapter)))


def _named_files(files: MultiValueDict) -> dict[str, UploadedFile]:
    """Files by their adapter file name: a part named after the file, or a `file` part carrying it as its
    filename. The services refuse any name other than the two."""
    named: dict[str, UploadedFile] = {}
    for field, uploads in files.lists():
        for one in uploads:
            name = one.name if field == "file" else field
            if name in named:
                raise errors.invalid(f"{name!r} was sent twice; send each of the two files once", "file")
            named[name] = one
    return named


@api_view("native", ("GET",))
def public_finetunes(request: HttpRequest, account_id: str) -> HttpResponse:
    """The adapters operators published to every account."""
    _who(request, account_id, READ)
    rows = [services.as_dict(a) for a in services.visible_adapters(account_id).filter(public=True)]
    info = {"page": 1, "per_page": len(rows), "count": len(rows), "total_count": len(rows)}
    return json_response(envelope(rows, result_info=info))


@api_view("native", ("GET", "DELETE"))
def finetune_detail(request: HttpRequest, account_id: str, ref: str) -> HttpResponse:
    if request.method == "GET":
        _who(request, account_id, READ)
        return json_response(envelope(services.as_dict(services.get_adapter(account_id, ref))))
    _who(request, account_id, ADMIN)
    adapter = services.get_adapter(account_id, ref, own_only=True)
    services.delete_adapter(account_id, adapter.pk)
    return json_response(envelope({"id": adapter.pk, "deleted": True}))


@api_view("native", ("POST",))
def finetune_assets(request: HttpRequest, account_id: str, ref: str) -> HttpResponse:
    """One of the two files: multipart `file_name` (adapter_config.json or adapter_model.safetensors) and
    `file`. Without `file_name`, the file part's own filename names it."""
    handler = _start_upload(request)
    _who(request, account_id, ADMIN, handler)
    adapter = services.get_adapter(account_id, ref, own_only=True)
    if handler is None:
        raise errors.invalid("Upload the file as multipart/form-data with fields file_name and file", "file")
    fields, files = _form(request, handler)
    uploads = files.getlist("file")
    if len(uploads) != 1 or len(files) != 1:
        raise errors.invalid("Send one file per request, as the multipart field `file` (with `file_name`)", "file")
    file_name = fields.get("file_name") or uploads[0].name
    return json_response(envelope(services.as_dict(services.add_asset(adapter, file_name, uploads[0]))))
