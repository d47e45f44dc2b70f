"""Neighbours for one interval (``solaris_jobs.pipeline.jobs.neighbours``): FM user embeddings, FAISS top-k on the
driver, neighbour embeddings. Outputs: ``user_embeddings``, ``neighbours``.

A spark-submit entry point; the job lives in the library and takes the same arguments as ``solaris neighbours``::

    spark-submit --master spark://HOST:7077 spark_jobs/neighbours.py --settings "$(cat settings.json)" \\
        --start 2026-01-05T00:00Z --end 2026-01-05T01:00Z       # or --data D --offline O --models M ...
"""
if __name__ == "__main__":
    from solaris_jobs.flows.cli import spark_submit_main
    spark_submit_main("neighbours")
