"""Data sources that produce the SOLARIS event-log contract (see ``solaris_jobs.events``)."""
