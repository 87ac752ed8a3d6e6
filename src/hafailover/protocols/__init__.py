"""The protocol code: one connection to one broker per link, no failover of its own.

``base`` holds what both protocols share (the ``Link`` the driver drives, the value an open
returns, the topology announcement); ``stomp`` and ``amqp`` translate between their client
library and hafailover's values and map the library's exceptions to hafailover's in one place
each; ``factory`` picks the link for a policy's protocol. The driver builds failover on top.
"""
