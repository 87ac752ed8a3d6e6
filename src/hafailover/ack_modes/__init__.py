"""One rule set per acknowledge mode: what acknowledge, recover and failover do (F6-F9, F14).

``rules_for(mode, session_id)`` gives the rule object a session consults for
every delivery, acknowledge, recover and failover. The rules are pure state;
the session carries out their decisions.
"""

from __future__ import annotations

from hafailover.ack_modes.auto import (
    PIPELINED_ACKS,
    AutoAckRules,
    DupsOkAckRules,
    NoAckRules,
)
from hafailover.ack_modes.base import (
    AckAction,
    AckDecision,
    AckRules,
    ConfirmFirst,
    Delivery,
    FailoverOutcome,
    RecoverDecision,
)
from hafailover.ack_modes.client import ClientAckRules, ClientIndividualAckRules
from hafailover.ack_modes.modes import AckMode, LinkReliability, check_link_reliability
from hafailover.ack_modes.transacted import TransactedAckRules

__all__ = [
    "PIPELINED_ACKS",
    "AckAction",
    "AckDecision",
    "AckMode",
    "AckRules",
    "AutoAckRules",
    "ClientAckRules",
    "ClientIndividualAckRules",
    "ConfirmFirst",
    "Delivery",
    "DupsOkAckRules",
    "FailoverOutcome",
    "LinkReliability",
    "NoAckRules",
    "RecoverDecision",
    "TransactedAckRules",
    "check_link_reliability",
    "rules_for",
]

_RULES: dict[AckMode, type[AckRules]] = {
    cls.mode: cls
    for cls in (
        AutoAckRules,
        DupsOkAckRules,
        NoAckRules,
        ClientAckRules,
        ClientIndividualAckRules,
        TransactedAckRules,
    )
}


def rules_for(mode: AckMode, session_id: int) -> AckRules:
    """The rule set for a new session in ``mode``."""
    return _RULES[mode](session_id)
