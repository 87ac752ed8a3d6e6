"""The reference broker's AMQP 1.0 server (see ``server`` for what it maps and how).

``sasl`` is the broker's own SASL layer (sans-IO), ``mapping`` the translation of addresses,
messages and errors between AMQP and the engine, ``server`` the asyncio protocol that joins
them to a proton transport.
"""

from reference_broker.amqp.server import (
    PRODUCER_CREDIT,
    TOPOLOGY_PROPERTY,
    AmqpConnection,
    serve_amqp,
)

__all__ = ["PRODUCER_CREDIT", "TOPOLOGY_PROPERTY", "AmqpConnection", "serve_amqp"]
