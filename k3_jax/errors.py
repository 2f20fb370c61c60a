"""Exception types shared by the config modules (a leaf: imports nothing from the project)."""


class ConfigError(ValueError):
    """A config file or value is invalid; the message names the key, the expected and the actual value."""
