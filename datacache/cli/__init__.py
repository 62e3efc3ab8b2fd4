"""The ``datacache`` command line: warm, stat, ls, index, write, verify, clear.

Guarantees: exit codes as documented (``main``); every error is one line naming the URL or path,
the cause and what to do; long operations show progress on stderr. Never imports torch.

May import every layer but ``pytorch``.
"""
from .main import main

__all__ = ["main"]
