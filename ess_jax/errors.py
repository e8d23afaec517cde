"""The errors `main` reports as one line (the traceback only with --verbose)."""


class UserError(Exception):
    """Something the user can fix: a config value, a busy workdir, an unreadable checkpoint."""
