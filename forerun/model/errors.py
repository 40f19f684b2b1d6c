"""Errors raised while locating or loading a model."""


class ModelLoadError(ValueError):
    """A model could not be found, understood or loaded; the message is meant for the user."""
