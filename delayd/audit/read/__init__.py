"""Reading the logs: each file as Arrow record batches, every frame checked by storage's
scanner and every problem a row. Imports pyarrow, never pyspark or trio: Spark's Python
workers run it."""
