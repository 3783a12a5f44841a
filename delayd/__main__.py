"""`python -m delayd` is the `delayd` command."""

import sys

from delayd.cli import main

sys.exit(main())
