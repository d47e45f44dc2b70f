"""The shared Spark Connect session `solaris airflow` gives its tasks. (The refresh through Spark Connect under the
real scheduler, and under spark-submit against a Spark standalone cluster, are tests/test_dags.py's.)"""
import json
import subprocess
import sys

from tests.support import SparkConnectServer


CLIENT = """
import json, os, sys
from solaris_jobs.pipeline.spark import parallelism, spark_session
spark = spark_session("client", sys.argv[1])

def pids(frames):
    import pandas as pd
    for pdf in frames:
        yield pd.DataFrame({"pid": [os.getpid()] * len(pdf)})

print(json.dumps({"pids": sorted({r.pid for r in spark.range(64, numPartitions=2).mapInPandas(pids, "pid long")
                                  .collect()}), "parallelism": parallelism(spark)}))
"""


def test_clients_of_the_shared_spark_connect_session_reuse_its_python_workers(tmp_path):
    """What `solaris airflow` gives its tasks: three client processes in a row on the server's shared session run
    their Python UDFs in the same Python workers (so the executors' model cache outlives a task), and the server's
    Python processes do not grow; each client on a session of its own gets new workers and leaves them behind.
    The jobs' parallelism is the server's local[2] cores (a client has no SparkContext to ask; unset, it was the
    client's 32 shuffle partitions and the FM inference ran as 32 tasks)."""
    import psutil

    def run(url):
        res = subprocess.run([sys.executable, "-c", CLIENT, url], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    def pythons(server):
        return sum("python" in p.name() for p in psutil.Process(server.proc.pid).children(recursive=True))

    with SparkConnectServer(tmp_path / "connect") as server:
        shared = [run(server.shared_url) for _ in range(3)]
        after_shared = pythons(server)
        own = [run(server.url) for _ in range(2)]
        after_own = pythons(server)
    assert server.master == "local[2]" and {r["parallelism"] for r in shared + own} == {2}
    shared, own = [r["pids"] for r in shared], [r["pids"] for r in own]
    assert shared[0] == shared[1] == shared[2] and len(shared[0]) >= 1
    assert not set(own[0]) & set(own[1]) and not set(own[0]) & set(shared[0])
    assert after_own > after_shared > 0
