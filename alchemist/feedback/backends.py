"""Which feedback log a location names: a PostgreSQL URL (``postgresql://`` or ``postgres://``) opens the log
shared by several processes (``alchemist.feedback.postgres_log``), anything else is the path of one process's
SQLite file (``alchemist.feedback.sqlite_log``), the default.

    log = open_feedback_log(config.server.feedback_db_path)
"""

from __future__ import annotations

from alchemist.feedback.log import FeedbackLog

SCHEMES = ("postgresql://", "postgres://")  # libpq's two URI schemes


def is_postgres_url(location: str) -> bool:
    return location.startswith(SCHEMES)


def open_feedback_log(location: str) -> FeedbackLog:
    if is_postgres_url(location):
        from alchemist.feedback.postgres_log import PostgresFeedbackLog  # psycopg loads only for a server that uses it

        return PostgresFeedbackLog(location)
    from alchemist.feedback.sqlite_log import SQLiteFeedbackLog

    return SQLiteFeedbackLog(location)
