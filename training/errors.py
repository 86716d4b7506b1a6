"""The exceptions that mean bad input (one line on the command line: ``training.KNOWN_ERRORS``)."""
from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(ValueError):
    """Arguments that cannot work (unknown model, missing file, impossible combination)."""
