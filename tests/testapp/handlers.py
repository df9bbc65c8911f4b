"""Found by outbox_app's autodiscovery of each installed app's ``handlers``."""

from outbox_app import handler

from .events import AuditRecorded
from .models import SideEffect


@handler(AuditRecorded)
def record_audit(event: AuditRecorded, context) -> None:
    SideEffect.objects.create(handler="record_audit", event_id=context.event_id)
