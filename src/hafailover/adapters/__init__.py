"""Protocol adapters: one connection to one broker each, no failover of their own.

Each adapter translates between its client library and hafailover's values and maps the
library's exceptions to hafailover's in one place. The driver builds failover on top.
"""
