"""Dev-only helpers, not used in production: a local Airflow (API server, scheduler, DAG processor, triggerer; on
LocalExecutor and SQLite, or CeleryExecutor with workers started one by one) on the project's DAGs
(``airflow_local``, behind ``solaris airflow``), a throw-away PostgreSQL for its metadata DB (``postgres_local``) and
a Spark Connect server (``spark_connect``).

May import: ``core``.
"""
