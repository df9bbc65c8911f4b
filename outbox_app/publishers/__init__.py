"""Broker destinations. ``base.Publisher`` is the interface; one module per
backend."""
