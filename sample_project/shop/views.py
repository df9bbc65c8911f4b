"""The shop's HTML page and its JSON endpoints (used by ``manage.py simulate``)."""

import json
from decimal import Decimal, InvalidOperation

from django.contrib import messages
from django.http import JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from . import services
from .models import Order


def shop(request):
    if request.method == "POST":
        try:
            total = Decimal(request.POST.get("total", ""))
        except InvalidOperation:
            messages.error(request, "Total must be a number.")
        else:
            order = services.place_order(request.POST.get("email", ""), total)
            messages.success(request, f"Order #{order.pk} placed.")
        return redirect("shop")
    orders = Order.objects.select_related("confirmationemail").order_by("-pk")[:20]
    return render(request, "shop/shop.html", {"orders": orders})


def _body(request) -> dict:
    try:
        return json.loads(request.body or b"{}")
    except ValueError:
        return {}


def _amount(data: dict, key: str) -> Decimal | None:
    try:
        value = Decimal(str(data.get(key, "")))
    except InvalidOperation:
        return None
    return value if value > 0 else None


@csrf_exempt
@require_POST
def place_order(request):
    data = _body(request)
    total = _amount(data, "total")
    if total is None or not data.get("email"):
        return JsonResponse({"error": "email and a positive total needed"}, status=400)
    order = services.place_order(
        data["email"], total, data.get("sku", ""), int(data.get("quantity", 1))
    )
    return JsonResponse({"order": order.pk, "status": order.status}, status=201)


@csrf_exempt
@require_POST
def pay_order(request, order_id: int):
    try:
        payment = services.pay_order(order_id)
    except Order.DoesNotExist:
        return JsonResponse({"error": "no such order"}, status=404)
    except services.InvalidTransition as exc:
        return JsonResponse({"error": str(exc)}, status=409)
    except services.InsufficientFunds as exc:
        return _insufficient(exc)
    return JsonResponse({"order": order_id, "payment": payment.pk})


@csrf_exempt
@require_POST
def cancel_order(request, order_id: int):
    try:
        services.cancel_order(order_id)
    except Order.DoesNotExist:
        return JsonResponse({"error": "no such order"}, status=404)
    except services.InvalidTransition as exc:
        return JsonResponse({"error": str(exc)}, status=409)
    return JsonResponse({"order": order_id, "status": "cancelled"})


@csrf_exempt
@require_POST
def deposit(request, owner: str):
    amount = _amount(_body(request), "amount")
    if amount is None:
        return JsonResponse({"error": "a positive amount needed"}, status=400)
    services.deposit(owner, amount)
    return JsonResponse({"owner": owner, "deposited": str(amount)})


@csrf_exempt
@require_POST
def withdraw(request, owner: str):
    amount = _amount(_body(request), "amount")
    if amount is None:
        return JsonResponse({"error": "a positive amount needed"}, status=400)
    try:
        services.withdraw(owner, amount)
    except services.InsufficientFunds as exc:
        return _insufficient(exc)
    return JsonResponse({"owner": owner, "withdrawn": str(amount)})


def _insufficient(exc: services.InsufficientFunds) -> JsonResponse:
    """409 with the ids of the events that rolled back (never delivered)."""
    return JsonResponse(
        {"error": str(exc), "rolled_back_events": exc.event_ids}, status=409
    )
