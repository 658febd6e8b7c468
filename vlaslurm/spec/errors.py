"""The one error type for bad experiment specs."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, List, Optional

COMMAND_LINE = "command line"


@dataclass(frozen=True)
class Location:
    """Where a key was written: a file and line, or the command line."""

    file: str
    line: Optional[int] = None

    def __str__(self) -> str:
        return self.file if self.line is None else f"{self.file}:{self.line}"


class SpecError(Exception):
    """A user error in a spec: names the dotted field, the file and line, and close valid names."""

    def __init__(
        self, message: str, key: str = "", location: Optional[Location] = None, suggestions: Iterable[str] = ()
    ) -> None:
        self.message = message
        self.key = key
        self.location = location
        self.suggestions: List[str] = list(suggestions)
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = f"{self.location}: " if self.location else ""
        field = f"{self.key}: " if self.key else ""
        hint = f" (did you mean: {', '.join(self.suggestions)}?)" if self.suggestions else ""
        return f"{where}{field}{self.message}{hint}"


def close_names(name: str, valid: Iterable[str], n: int = 3) -> List[str]:
    """Valid names that look like `name`, best first."""
    return difflib.get_close_matches(name, list(valid), n=n, cutoff=0.6)
