"""The pure core: every failover rule decided once, with no I/O.

The failover machine (``failover``), the calls in flight with the sessions' windows and the
failover plan (``inflight``), the confirmation window (``window``), the reconnect schedule
(``schedule``), the duplicate window (``dedup``) and the failover report (``report``). With
``hafailover.ack_modes``, ``hafailover.tx`` and the value modules (``errors``, ``url``,
``destination``, ``message``, ``_units``) it is the core of docs/core.md: no sockets, threads,
clocks, stomp.py or proton, and it imports with neither client library installed.
"""
