"""The audit: prove from the data directories alone that every accepted message was
delivered once, on time, and list the ones that were not (docs/audit.md).

``files`` lists the log files of a data directory, ``decode`` turns them into Arrow
record batches with the logs' own codecs, ``schemas`` names the columns. Those three
need only pyarrow. ``sources`` (the PySpark data sources), ``session``, ``job`` (the
reconciliation) and ``command`` (``delayd audit``) need pyspark, the ``audit`` extra;
nothing outside this package imports them, so the server runs without it.
"""
