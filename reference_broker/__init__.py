"""The reference broker pair: a live and a backup node with a replicated journal.

It speaks STOMP 1.2 and AMQP 1.0 so that hafailover can be run and tested against
real failures on one machine (docs/broker.md). It may import protocol constants from
hafailover; hafailover never imports it.
"""

from reference_broker.pair import BrokerPair, NodeProcess, PairError

__all__ = ["BrokerPair", "NodeProcess", "PairError"]
