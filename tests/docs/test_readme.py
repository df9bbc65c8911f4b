"""What the README asks of a new user comes before what needs it."""

from .blocks import ROOT

README = (ROOT / "README.md").read_text()


def test_a_login_is_created_before_the_admin_is_shown():
    """The first hour: the README sends the reader to the admin after the
    command that makes a login for it (it once went straight to a login
    page nobody could pass)."""
    created = README.find("manage.py createsuperuser")
    assert created != -1, "the README never says createsuperuser"
    for place in ("http://127.0.0.1:8000/admin/", "the outbox in the admin"):
        assert README.find(place) != -1, place
        assert created < README.find(place), place
