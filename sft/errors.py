"""Errors that sft reports to the user as one paragraph, without a traceback, and the exit code of a run stopped on
request. Nothing here imports a library: the launcher's agent (`sft.parallel.launch`) reads them without paying for
torch's and transformers' imports."""

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request with a complete checkpoint; run the same command again


class SFTError(ValueError):
    """A problem with the user's input: the message names the field or file, the value, and the fix."""


class ConfigError(SFTError):
    """A recipe key, flag value or config file is wrong."""


class DataError(SFTError):
    """A data source or one of its records is wrong."""
