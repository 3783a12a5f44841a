"""The audit as a Spark application, from a checkout:

    spark-submit --master spark://host:7077 tools/audit_job.py \\
        --data eu-1=/mnt/delayd/eu-1 --data eu-2=/mnt/delayd/eu-2 --out /mnt/audit/today

The application is delayd.cli.spark_submit.audit_job, which an installed delayd runs as
``spark-submit "$(delayd audit --job-path)" …``; see its docstring and docs/audit.md.
"""

from __future__ import annotations

import sys

from delayd.cli.spark_submit.audit_job import main

if __name__ == "__main__":
    sys.exit(main(prog="audit_job.py"))
