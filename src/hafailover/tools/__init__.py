"""The command-line clients behind ``hafailover producer``, ``consumer``, ``browser`` and
``perf``, usable from Python too (the live demo runs them on threads).

They use only the public API; what they add is bookkeeping: the ``seq`` header on every
message, the per-message record file, the summary and the progress line.
"""

from hafailover.tools._common import ACK_MODES, OptionError, Progress, Recorder
from hafailover.tools.browser import BrowserOptions, BrowserResult, run_browser
from hafailover.tools.consumer import ConsumerOptions, ConsumerResult, run_consumer, seq_of
from hafailover.tools.producer import ProducerOptions, ProducerResult, run_producer

__all__ = [
    "ACK_MODES",
    "BrowserOptions",
    "BrowserResult",
    "ConsumerOptions",
    "ConsumerResult",
    "OptionError",
    "ProducerOptions",
    "ProducerResult",
    "Progress",
    "Recorder",
    "run_browser",
    "run_consumer",
    "run_producer",
    "seq_of",
]
