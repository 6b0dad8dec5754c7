from genq.core.redisconn import (  # noqa: F401  (moved to redisconn)
    FULL,
    NO_DISK,
    NOTE_REASONS,
    REPLICA,
    RedisNote,
    in_words,
    redis_note,
    redis_note_of,
    refusal,
    trouble,
)
