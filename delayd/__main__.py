"""`python -m delayd` is the `delayd` command."""

import sys

from delayd.cli.main import main

sys.exit(main())
