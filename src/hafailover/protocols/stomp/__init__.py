"""STOMP 1.2: the frame codec (``frame``, shared with the reference broker), one connection on
stomp.py (``transport``) and the driver's link over it (``link``)."""
