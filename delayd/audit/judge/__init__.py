"""Judging: what the records of a run of buckets, and of one message id, decide — in
Arrow, in the task that read them, so Spark moves a few rows and no records. pyarrow
only."""
