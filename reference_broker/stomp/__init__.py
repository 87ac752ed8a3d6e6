"""STOMP 1.2 for the reference broker: the sans-IO frame codec lives in `codec`."""
