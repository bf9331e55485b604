"""The one exception type fxopt raises for anything the caller did or gave."""


class FxoptError(ValueError):
    """A clear, user-facing error: bad input, an untraceable model, a failed verification."""
