from genq.core.records import bucket_bounds, length_bucket  # noqa: F401  (moved to records)
