from genq.core.records import EnqueueRecord, JobRecord, ShardMarker  # noqa: F401  (the output's records, moved)
