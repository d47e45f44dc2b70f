"""One whole refresh of an interval in one Spark session (``solaris_jobs.pipeline.jobs.run``): selection -> FM
inference -> user aggregates -> neighbours. (The Airflow DAG runs the same steps as separate tasks.)

A spark-submit entry point; the job lives in the library and takes the same arguments as ``solaris refresh``::

    spark-submit --master spark://HOST:7077 spark_jobs/refresh.py --settings "$(cat settings.json)" \\
        --start 2026-01-05T00:00Z --end 2026-01-05T01:00Z       # or --data D --offline O --models M ...
"""
if __name__ == "__main__":
    from solaris_jobs.flows.cli import spark_submit_main
    spark_submit_main("refresh")
