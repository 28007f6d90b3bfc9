"""Errors the user can fix. The CLI prints them as one paragraph, without a traceback."""
from __future__ import annotations


class UserError(Exception):
    """A run that cannot go on for a reason the user caused; `status` goes to summary.json."""

    status = "error"

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class ConfigError(UserError):
    """A setting with a bad value: says which setting, what is wrong, and how to fix it."""

    def __init__(self, setting: str, problem: str, fix: str):
        self.setting, self.problem, self.fix = setting, problem, fix
        super().__init__(f"Invalid setting `{setting}`: {problem}. Fix: {fix}.")


class TooFewNodes(ConfigError):
    """A strategy cannot start on the live nodes the job has (fewer than its smallest job).
    Raised by a strategy's first `plan`; on the modelled clock the run loop then waits for
    timed joins (a trace's later adds) and asks again, and raises it when none brings enough."""


class ResultError(UserError):
    """A run that ends early as a result ("oom", "unrecoverable"), not because of a bad setting."""

    def __init__(self, status: str, message: str):
        super().__init__(message, status)


class ReplayUnavailable(ResultError):
    """Swift's replay cannot start as planned: its checkpoint or a log file it needs does not
    verify (nothing was used). `start`: an older checkpoint whose replay does verify, else
    None. The run loop falls back (a replay from `start`, else a restart of the job from the
    newest checkpoint that verifies); a backend that cannot leaves the run unrecoverable."""

    def __init__(self, message: str, start: int | None = None):
        super().__init__("unrecoverable", message)
        self.start = start
