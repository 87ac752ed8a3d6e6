"""Zero prefetch (``prefetch=0``): a consumer that holds no message it did not ask for.

A consumer with a prefetch is sent messages ahead of its receive() calls, up to its
prefetch, and holds them until the application asks: a slow consumer holds messages other
consumers could have had, and a failover sends back everything it held. A pull consumer
asks for one message only while a receive() waits, and takes the request back when the
receive ends without one (its timeout): the broker then either sends a message (which the
ending receive returns: none is left in a buffer nobody reads) or gives the request back.

The protocol decides whether a client can do that (``prefetch_refusal``):

- AMQP 1.0: yes. The receiver grants link credit; a pull consumer's link has none until a
  receive waits, then one, and a receive that times out drains it (a flow with drain set:
  the broker uses the credit or returns it, and says which before the receive returns).
  After a failover the consumer is attached again with no credit, and the waiting receive
  grants it on the new link; a message sent on the old link and not handed out is dropped
  with it and redelivered by the broker (F5, F6), so nothing is lost or handed out twice.
- STOMP: no. A subscription's flow control is a window of unacknowledged messages
  (``prefetch-count``, ``activemq.prefetchSize``), at least one; nothing a client sends
  asks for one message or takes a request back, so a STOMP consumer always holds at least
  one message ahead. prefetch=0 is refused with the reason rather than quietly made 1.

Pure: values in, a decision out.
"""

from __future__ import annotations

from hafailover.url import Protocol

__all__ = ["prefetch_refusal"]


def prefetch_refusal(prefetch: object, protocol: Protocol) -> str | None:
    """Why a consumer cannot have this prefetch on this protocol, or None when it can."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        return f"prefetch must be a whole number >= 0, not {prefetch!r}"
    if prefetch == 0 and protocol is Protocol.STOMP:
        return (
            "prefetch=0 needs a protocol in which a client asks for each message: STOMP's "
            "flow control is a window of at least one unacknowledged message the broker "
            "sends ahead (prefetch-count), with no way to ask for one or take a request "
            "back; use prefetch=1 on STOMP, or AMQP for a consumer that holds nothing"
        )
    return None
