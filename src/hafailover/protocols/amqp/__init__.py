"""AMQP 1.0: proton's errors mapped to ours (``errors``), the message codec (``codec``), the
sans-I/O proton engine (``engine``), its socket and reader thread (``transport``) and the
driver's link over it (``link``)."""
