"""hafailover: client-side failover for STOMP and AMQP 1.0 messaging."""
