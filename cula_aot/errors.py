"""The error every entry point raises for a bad argument, before anything launches."""


class KDAInputError(ValueError):
    """A cula_aot call's argument is invalid; the message names it and the fix."""


def fail(message: str):
    raise KDAInputError(message)
