"""A griffe extension for the API reference: fdp's "Example:" sections are examples.

fdp's docstrings title their doctests ``Example:`` (Google style allows both); griffe's
Google parser knows only ``Examples:`` and would render the doctests as prose, with
``x[1, 4]`` read as a Markdown link. The docstrings stay as they are.
"""

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)


class ExampleSections(griffe.Extension):
    """Renames each docstring's ``Example:`` section to ``Examples:`` before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Called by griffe for every object it loads."""
        del kwargs
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
