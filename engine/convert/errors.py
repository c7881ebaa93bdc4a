"""The converter's one error type: a user-facing refusal (the CLI prints it as one line)."""

from __future__ import annotations


class ConversionError(ValueError):
    """The input is not something the converter recognises; the message names what and where."""
