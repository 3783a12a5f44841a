"""The files spark-submit runs. A directory of their own: spark-submit runs a file as a
script, which puts its directory first on sys.path, and delayd/cli's own modules
(inspect.py) would shadow the standard library's."""
