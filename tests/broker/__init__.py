"""Tests of the reference broker itself."""

# The lease of a module's shared live node that no test takes over: long enough that a
# machine loaded by the rest of the suite does not make it fence itself. With the pairs'
# default lease (1.5 s; a live stops serving 1.2 s after its last renewal) a node whose
# lease keeper was starved that long fenced and was away for a second, and the module's
# next tests were refused.
SHARED_NODE_LEASE = 10.0
