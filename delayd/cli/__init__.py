"""The ``delayd`` command: main.py dispatches, one module per subcommand, and args.py
holds the argument types they share.

The top layer: nothing else in delayd imports it. Each subcommand's module is imported
only when that subcommand runs, so ``delayd serve`` does not load the operator tools.
"""
