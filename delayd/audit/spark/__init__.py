"""The Spark job: data sources over a data directory's logs, the SparkSession, and the
job that reads, crosses buckets and servers and writes the tables (pyspark >= 4)."""
