"""User aggregates for one interval (``solaris_jobs.pipeline.jobs.aggregate``): per user, the mean of their pair
embeddings of the trailing window. Output: ``user_aggregates``.

A spark-submit entry point; the job lives in the library and takes the same arguments as ``solaris aggregate``::

    spark-submit --master spark://HOST:7077 spark_jobs/user_aggregates.py --settings "$(cat settings.json)" \\
        --start 2026-01-05T00:00Z --end 2026-01-05T01:00Z       # or --data D --offline O --models M ...
"""
if __name__ == "__main__":
    from solaris_jobs.flows.cli import spark_submit_main
    spark_submit_main("aggregate")
