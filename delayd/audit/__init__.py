"""The audit: prove from the data directories alone that every accepted message was
delivered once, on time, and list the ones that were not (docs/audit.md).

By stage, each a package:

* ``read`` — the logs' files as Arrow record batches, decoded with the logs' own codecs,
  damage as problem rows (pyarrow only: it runs in Spark's Python workers).
* ``judge`` — what a run of buckets decides where it was read (pairing records with
  their dispatch_log entries, the verdict on each, counts and percentiles, findings) and
  what the ids decide across buckets; the summary added up on the driver (pyarrow only).
* ``spark`` — the PySpark data sources, the session and the job that reads every
  server's logs once, crosses buckets and servers, and writes the Parquet tables.
* ``report`` — what a run found, as the console table and the HTML page.

``kinds`` names the problems, findings and severities, ``schemas`` the Arrow columns
every stage shares, ``config`` what a run is asked to do (``delayd audit`` is delayd/cli/audit.py).
``spark`` needs pyspark, the ``audit`` extra; nothing outside this package but
delayd/cli/audit.py imports it, so the server runs without it.
"""
