"""Errors that reach the user as one line."""


class ConfigError(ValueError):
    """A config problem the user can fix; its message is one line naming the key, the bad
    value and what is allowed."""
