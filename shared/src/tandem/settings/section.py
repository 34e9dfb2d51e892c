"""What every settings section shares: its attributes' docstrings as their descriptions (the
configuration reference), and numbers that must be finite.

`inf` and `nan` are refused by name ("Input should be a finite number") rather than passed on:
no setting means "no limit" by infinity, and `nan` fails every bound with a message about the
bound instead of the value.
"""

from __future__ import annotations

from pydantic import ConfigDict

SECTION = ConfigDict(use_attribute_docstrings=True, allow_inf_nan=False)
