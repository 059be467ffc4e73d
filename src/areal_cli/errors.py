"""Typed user-facing errors.

Every mistake a user can make surfaces as an :class:`ArealError`. The CLI turns it into one red line
and exit code 1 (``UsageError``: 2). Internal invariants may still ``assert``; user input never does.
"""

from __future__ import annotations

from collections.abc import Sequence


def did_you_mean(word: str, options) -> str:
    """``"did you mean 'x'? "`` for the closest of ``options``, or ``""``: the start of an error's hint."""
    import difflib

    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"did you mean '{match[0]}'? " if match else ""


# A process of the run (a trainer rank) that dies of an ArealError prints it on one line behind this prefix;
# the launcher shows that line alone instead of the log's traceback (launchers/failures.py:user_error_in).
USER_ERROR_PREFIX = "areal user error: "
# Any other exception that kills a trainer rank: its traceback, then its last line behind this prefix, which
# the launcher watches for to stop the run at once (launchers/failures.py:RankLogWatch).
RANK_CRASH_PREFIX = "areal rank crashed: "


class ArealError(Exception):
    """Base of all errors that are the user's to fix. ``str()`` is the one line the CLI prints."""

    exit_code = 1
    # Lines the CLI prints under that one line: where it was raised and its log, the command that resumes.
    details: Sequence[str] = ()


class ConfigError(ArealError):
    """A configuration value is wrong.

    ``path`` is the dotted config path (``rollout.group_size``), ``reason`` says what is wrong,
    ``hint`` says what to set instead. ``text``/``column`` optionally locate a bad character
    inside a string value so the CLI can draw a caret under it.
    """

    def __init__(self, path: str, reason: str, hint: str = "", *, text: str | None = None,
                 column: int | None = None):
        self.path = path
        self.reason = reason
        self.hint = hint
        self.text = text
        self.column = column
        super().__init__(self.one_line())

    def one_line(self) -> str:
        msg = f"{self.path}: {self.reason}"
        if self.hint:
            msg += f" — fix: {self.hint}"
        return msg

    def __reduce__(self):
        # Exceptions pickle as cls(*args), and args is the one line: rebuild from the fields instead, so the
        # error crosses process boundaries (the rollout worker's pipe, Ray) as itself, not as an internal error.
        return (_config_error, (type(self), self.path, self.reason, self.hint, self.text, self.column),
                dict(self.__dict__))

    def caret_lines(self) -> list[str]:
        """Two lines showing the offending value with a caret under the bad character, or []."""
        if self.text is None or self.column is None:
            return []
        return [f"  {self.text}", "  " + " " * max(0, self.column) + "^"]

    def to_dict(self) -> dict:
        return {"path": self.path, "reason": self.reason, "hint": self.hint,
                "text": self.text, "column": self.column}


def _config_error(cls, path, reason, hint, text, column):
    # ConfigError's own __init__ on an instance of the subclass: subclasses take other arguments
    # (UnsupportedModelError(reason)), and their extra fields come back from the pickled __dict__.
    err = Exception.__new__(cls)
    ConfigError.__init__(err, path, reason, hint, text=text, column=column)
    return err


class UsageError(ArealError):
    """The command line itself is malformed (exit code 2)."""

    exit_code = 2


class StorageError(ArealError):
    """A storage check failed in a way that must stop a launch."""


class LaunchError(ArealError):
    """A process could not be started or died; the message names it and shows its log tail."""


class InferenceError(ArealError):
    """An inference server rejected a request or could not be reached."""


class WeightSyncError(ArealError):
    """A weight update failed or timed out; the message names the peer."""


class DataError(ArealError):
    """A dataset is missing or unreadable."""
