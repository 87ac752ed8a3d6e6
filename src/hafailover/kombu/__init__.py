"""Celery and kombu on hafailover: a kombu transport over STOMP and AMQP 1.0 with failover.

Importing this module registers the transport under kombu's alias ``hafailover``, so that
``broker_url = "hafailover+failover:(stomp://h1:61613,stomp://h2:61613)"`` selects it; the
transport path ``hafailover.kombu:Transport`` (Celery's ``broker_transport``) works without
the import. Needs the ``celery`` extra (kombu). See docs/celery.md.
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

from hafailover.kombu.transport import Channel, Transport

__all__ = ["ALIAS", "Channel", "Transport"]

ALIAS = "hafailover"

TRANSPORT_ALIASES.setdefault(ALIAS, "hafailover.kombu:Transport")
