"""The dashboard's Models page: the catalog with prices and defaults, operator edits, and the playground.

Operators (is_staff) change a model's price (a new Price row, now or later) and its request defaults
(speculation, KV compression) through the catalog services; everyone else sees the same figures without forms.
The playground streams from `controlplane.serving.playground`, routed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import path, reverse
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from controlplane.accounts.services import user_can_access
from controlplane.catalog.models import AiModel, Price, Task
from controlplane.catalog.services import (
    ModelEntry,
    PriceSnapshot,
    catalog,
    change_price,
    set_engine_defaults,
)
from controlplane.dashboard.access import account_or_404
from controlplane.serving import playground
from inference.models.catalog import DEFAULT_MODEL
from inference.spec.settings import MAX_SPECULATIVE_TOKENS, SpecMode


class FormError(Exception):
    """A submitted value that cannot be used; the page shows the message next to the form, with status 400."""


@dataclass
class PriceLine:
    """A price as the page shows it: numbers as an operator would type them."""

    price_id: int
    effective_at: datetime
    state: str  # current | scheduled | past
    input: str
    cached: str
    output: str
    usd_per_1k: str
    discount: str | None  # None: the deployment's default
    note: str = ""


@dataclass
class ModelRow:
    entry: ModelEntry
    price: PriceLine | None  # the one in effect now
    usd_per_m: tuple[str, ...] | None  # dollars per million input, cached input, output tokens
    batch_discount: str  # in effect for batch work: the price's own or the deployment's
    history: list[PriceLine]
    state: str
    kv_label: str
    price_form: dict[str, str] = field(default_factory=dict)
    defaults_form: dict[str, str] = field(default_factory=dict)
    error: dict[str, str] = field(default_factory=dict)  # form name -> message
    open: bool = False

    @property
    def generates(self) -> bool:
        return self.entry.task == Task.TEXT_GENERATION

    @property
    def context_label(self) -> str:
        return f"{self.entry.context_window:,}"

    @property
    def task_label(self) -> str:
        return dict(Task.choices).get(self.entry.task, self.entry.task)

    @property
    def draft_model(self) -> str | None:
        return self.entry.speculation["draft_model"]


def _state(entry: ModelEntry) -> str:
    if not entry.installed:
        return "not installed"
    if entry.deprecated:
        return f"deprecated since {entry.deprecated_on:%Y-%m-%d}"
    if entry.deprecated_on is not None:
        return f"installed; deprecated from {entry.deprecated_on:%Y-%m-%d}"
    return "installed"


def _kv_label(entry: ModelEntry) -> str:
    kv = entry.kv_compression
    if kv is None:
        return "off"
    if "rate" in kv:
        return f"keep 1/{_plain(Decimal(str(kv['rate'])))}"
    return f"≤ {kv['max_cache_tokens']:,} entries per head"


def _plain(value: Decimal, *, grouped: bool = False) -> str:
    """1500.0000 -> '1500' (or '1,500'), 0.0110 -> '0.011': what an operator typed, without the column's
    padding."""
    return format(value.normalize(), ",f" if grouped else "f") if value else "0"


def _line(p: Price, state: str) -> PriceLine:
    return PriceLine(price_id=p.pk, effective_at=p.effective_at, state=state,
                     input=_plain(p.neurons_per_m_input, grouped=True),
                     cached=_plain(p.neurons_per_m_cached_input, grouped=True),
                     output=_plain(p.neurons_per_m_output, grouped=True),
                     usd_per_1k=_plain(p.usd_per_1k_neurons), note=p.note,
                     discount=None if p.batch_discount_percent is None else _plain(p.batch_discount_percent))


def _rows(now: datetime) -> list[ModelRow]:
    """Every active model as the API sees it (the catalog snapshot), with its price rows for the history."""
    entries = sorted(catalog().values(), key=lambda e: (e.task, e.name))
    prices: dict[int, list[Price]] = {}
    for p in Price.objects.filter(model_id__in=[e.pk for e in entries]).order_by("-effective_at"):
        prices.setdefault(p.model_id, []).append(p)
    rows = []
    for entry in entries:
        current = entry.price_at(now.timestamp())
        history = [_line(p, "scheduled" if p.effective_at > now else
                         "current" if current and p.pk == current.price_id else "past")
                   for p in prices.get(entry.pk, [])]
        in_effect = next((line for line in history if line.state == "current"), None)
        usd = None if current is None else tuple(
            _plain(current.cost_usd(n).quantize(Decimal("0.000001")))
            for n in (current.neurons_per_m_input, current.neurons_per_m_cached_input, current.neurons_per_m_output))
        rows.append(ModelRow(
            entry=entry, price=in_effect, usd_per_m=usd,
            batch_discount=_plain(current.batch_discount()) if current else "", history=history,
            state=_state(entry), kv_label=_kv_label(entry), price_form=_price_initial(current),
            defaults_form=_defaults_initial(entry)))
    return rows


def _price_initial(price: PriceSnapshot | None) -> dict[str, str]:
    """The price form starts from the price in effect, so a change is an edit of what is there."""
    blank = {"effective_at": "", "note": ""}
    if price is None:
        return {"input": "", "cached": "", "output": "", "usd_per_1k": "", "discount": "", **blank}
    return {"input": _plain(price.neurons_per_m_input), "cached": _plain(price.neurons_per_m_cached_input),
            "output": _plain(price.neurons_per_m_output), "usd_per_1k": _plain(price.usd_per_1k_neurons),
            "discount": "" if price.batch_discount_percent is None else _plain(price.batch_discount_percent),
            **blank}


def _defaults_initial(entry: ModelEntry) -> dict[str, str]:
    kv = entry.kv_compression or {}
    mode = "rate" if "rate" in kv else "max_cache_tokens" if "max_cache_tokens" in kv else "off"
    value = kv.get("rate", kv.get("max_cache_tokens", ""))
    return {"speculation": entry.speculation["mode"], "k": str(entry.speculation["k"]), "kv_mode": mode,
            "kv_value": "" if value == "" else _plain(Decimal(str(value)))}


# ------------------------------------------------------------------------------------------- form parsing
def _decimal(post: Any, name: str, label: str, *, required: bool = True) -> Decimal | None:
    text = post.get(name, "").strip().replace(",", "")
    if not text:
        if required:
            raise FormError(f"{label}: enter a number")
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise FormError(f"{label}: {text!r} is not a number") from None
    if not value.is_finite():
        raise FormError(f"{label}: {text!r} is not a number")
    return value


def _effective_at(post: Any) -> datetime | None:
    text = post.get("effective_at", "").strip()
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise FormError(f"Effective from: {text!r} is not a date and time (YYYY-MM-DD HH:MM, UTC)") from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when


def _kv_choice(post: Any) -> dict[str, Any] | None:
    mode = post.get("kv_mode", "off")
    text = post.get("kv_value", "").strip()
    if mode == "off":
        return None
    if mode not in ("rate", "max_cache_tokens"):
        raise FormError(f"KV compression: unknown choice {mode!r}")
    if not text:
        raise FormError("KV compression: enter a rate (keep 1/rate of the entries) or a number of entries")
    try:
        value: float | int = float(text) if mode == "rate" else int(text)
    except ValueError:
        raise FormError(f"KV compression: {text!r} is not a {'number' if mode == 'rate' else 'whole number'}") \
            from None
    return {mode: value}


def _validation_message(exc: ValidationError) -> str:
    labels = {"neurons_per_m_input": "Input", "neurons_per_m_cached_input": "Cached input",
              "neurons_per_m_output": "Output", "usd_per_1k_neurons": "$ per 1,000 neurons",
              "batch_discount_percent": "Batch discount", "effective_at": "Effective from", "k": "k",
              "speculation": "Speculation", "kv_compression": "KV compression", "__all__": ""}
    if not hasattr(exc, "error_dict"):
        return "; ".join(exc.messages)
    parts = []
    for name, problems in exc.message_dict.items():
        label = labels.get(name, name)
        parts.extend(f"{label}: {p}" if label else p for p in problems)
    return "; ".join(parts)


def _edit_price(post: Any, model: AiModel) -> str:
    effective_at = _effective_at(post)
    change_price(model, input_neurons=_decimal(post, "input", "Input"),  # type: ignore[arg-type]
                 cached_input_neurons=_decimal(post, "cached", "Cached input"),  # type: ignore[arg-type]
                 output_neurons=_decimal(post, "output", "Output"),  # type: ignore[arg-type]
                 usd_per_1k_neurons=_decimal(post, "usd_per_1k", "$ per 1,000 neurons", required=False),
                 batch_discount_percent=_decimal(post, "discount", "Batch discount", required=False),
                 effective_at=effective_at, note=post.get("note", ""))
    if effective_at is not None and effective_at > timezone.now():
        return f"New price for {model.name} scheduled from {effective_at:%Y-%m-%d %H:%M} UTC."
    return f"New price for {model.name} in effect now."


def _edit_defaults(post: Any, model: AiModel) -> str:
    text = post.get("k", "").strip()
    try:
        k = int(text)
    except ValueError:
        raise FormError(f"k: {text!r} is not a whole number from 1 to {MAX_SPECULATIVE_TOKENS}") from None
    set_engine_defaults(model, speculation=post.get("speculation", ""), k=k, kv_compression=_kv_choice(post))
    return f"Defaults for {model.name} saved; the next request uses them."


def _model_or_error(post: Any) -> AiModel:
    model_id = post.get("model_id", "").strip()
    model = AiModel.objects.filter(pk=int(model_id), is_active=True).first() \
        if model_id.isascii() and model_id.isdigit() and len(model_id) <= 18 else None
    if model is None:
        raise FormError("That model is not in the catalog")
    return model


# ------------------------------------------------------------------------------------------------- views
@login_required
@require_http_methods(["GET", "POST"])
def page(request: HttpRequest, account_id: str) -> HttpResponse:
    account, accounts = account_or_404(request, account_id)
    operator = bool(request.user.is_staff)
    context: dict[str, Any] = {"account": account, "accounts": accounts, "page": "models", "operator": operator}
    status = 200
    failed: tuple[str, str] | None = None  # (model id, form) whose error and values the page shows
    if request.method == "POST":
        if not operator:
            context["error"] = "Only operators can change prices and defaults."
            status = 403
        else:
            action = request.POST.get("action", "")
            try:
                model = _model_or_error(request.POST)
                if action == "price":
                    notice = _edit_price(request.POST, model)
                elif action == "defaults":
                    notice = _edit_defaults(request.POST, model)
                else:
                    raise FormError(f"Unknown action {action!r}")
                messages.success(request, notice)
                return redirect(reverse("dashboard-models", args=[account.pk]) + f"#model-{model.pk}")
            except (FormError, ValidationError) as exc:
                message = str(exc) if isinstance(exc, FormError) else _validation_message(exc)
                status = 400
                failed = (request.POST.get("model_id", ""), action)
                context["error_message"] = message
    rows = _rows(timezone.now())
    for row in rows:
        if failed and str(row.entry.pk) == failed[0] and failed[1] in ("price", "defaults"):
            # The error goes next to its form, which keeps what the operator typed.
            form = "price_form" if failed[1] == "price" else "defaults_form"
            setattr(row, form, {name: request.POST.get(name, "") for name in getattr(row, form)})
            row.error[failed[1]], row.open = context["error_message"], True
    if failed and not any(row.error for row in rows):
        context["error"] = context["error_message"]
    chat_models = [r.entry for r in rows if r.generates and r.entry.installed]
    context.update(
        rows=rows, playground_models=chat_models,
        playground_default=DEFAULT_MODEL if any(e.name == DEFAULT_MODEL for e in chat_models) else
        (chat_models[0].name if chat_models else ""),
        can_run=user_can_access(request.user, account.pk, manage=True),
        speculation_modes=[m.value for m in SpecMode], max_k=MAX_SPECULATIVE_TOKENS,
        playground_defaults={"max_tokens": playground.DEFAULT_MAX_TOKENS,
                             "temperature": playground.DEFAULT_TEMPERATURE})
    return render(request, "dashboard/models.html", context, status=status)


urlpatterns = [
    path("<str:account_id>/models/", page, name="dashboard-models"),
    path("<str:account_id>/models/playground/", playground.run, name="dashboard-playground"),
]
