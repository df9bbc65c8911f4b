from django.urls import path

from . import views

urlpatterns = [
    path("", views.shop, name="shop"),
    path("api/orders", views.place_order, name="place-order"),
    path("api/orders/<int:order_id>/pay", views.pay_order, name="pay-order"),
    path("api/orders/<int:order_id>/cancel", views.cancel_order, name="cancel-order"),
    path("api/wallets/<str:owner>/deposit", views.deposit, name="deposit"),
    path("api/wallets/<str:owner>/withdraw", views.withdraw, name="withdraw"),
]
