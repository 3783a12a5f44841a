"""The audit: prove from the data directories alone that every accepted message was
delivered once, on time, and list the ones that were not (docs/audit.md).

``files`` lists the log files of a data directory, ``decode_messages`` and
``decode_dispatch`` turn them into Arrow record batches with the logs' own codecs
(``fields`` cuts a column of payloads), ``schemas`` names the columns; ``pairs``,
``judge``, ``tally``, ``findings``, ``ids`` and ``reconciled`` decide what a bucket's own
files decide, where they are read, and ``id_checks`` what the records of one id decide
(sent twice, delivered though cancelled). Those need only pyarrow. ``sources`` (the PySpark
data sources), ``session``, ``job`` (with ``inputs``, ``reconcile``, ``message_check``,
``summary`` and ``outputs``) need pyspark, the ``audit`` extra; nothing outside this
package imports them but ``delayd audit`` (delayd/cli/audit.py) once it runs, so the
server runs without it.
"""
