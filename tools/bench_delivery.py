"""The delivery benchmark (issue 5), from a checkout: ``delayd bench`` with this
checkout's delayd first on the path. The benchmark is delayd/bench/delivery.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from delayd.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
