from decimal import Decimal, InvalidOperation

from django.contrib import messages
from django.shortcuts import redirect, render

from .models import Order
from .services import place_order


def shop(request):
    if request.method == "POST":
        try:
            total = Decimal(request.POST.get("total", ""))
        except InvalidOperation:
            messages.error(request, "Total must be a number.")
        else:
            order = place_order(request.POST.get("email", ""), total)
            messages.success(request, f"Order #{order.pk} placed.")
        return redirect("shop")
    orders = Order.objects.select_related("confirmationemail").order_by("-pk")[:20]
    return render(request, "shop/shop.html", {"orders": orders})
