"""Errors that sft reports to the user as one paragraph, without a traceback."""


class SFTError(ValueError):
    """A problem with the user's input: the message names the field or file, the value, and the fix."""


class ConfigError(SFTError):
    """A recipe key, flag value or config file is wrong."""


class DataError(SFTError):
    """A data source or one of its records is wrong."""
