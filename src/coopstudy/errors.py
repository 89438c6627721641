"""Errors a user can fix. The CLI prints them as one line and exits 2; any
other exception is a bug and keeps its traceback."""


class UserError(Exception):
    """Bad input, a missing prerequisite or a refused action."""


class ConfigError(UserError):
    """A preset or override that does not validate."""


class RefusedError(UserError):
    """A stage refused to run: a commitment it depends on is missing or changed."""
