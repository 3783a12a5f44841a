"""The version of the delayd distribution, a leaf any layer may import: the clients and
the sender name themselves with it in HELLO, ``delayd --version`` prints it, and
pyproject.toml reads it from here (``[tool.setuptools.dynamic]``)."""

__version__ = "0.1.0"
