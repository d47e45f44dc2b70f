"""Dev-only helpers, not used in production: a local Airflow (API server, scheduler, DAG processor, triggerer) on
the project's DAGs (``airflow_local``, behind ``solaris airflow``) and a free loopback port (``ports``).

May import: ``core``.
"""
