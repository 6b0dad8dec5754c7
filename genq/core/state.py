from genq.core.ledger.figures import FINISHED_STATUSES, JOB_STATUSES, JobStatus, job_status  # noqa: F401  (moved)
