"""The public API's connection classes, kept importable from their first home.

The threaded driver lives in ``hafailover.driver``; this module only re-exports it.
"""

from hafailover import driver
from hafailover.driver import *  # noqa: F403 - the same names, by design

__all__ = driver.__all__
