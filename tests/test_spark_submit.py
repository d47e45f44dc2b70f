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


GPU_CLIENT = """
import json, sys
from solaris_jobs.pipeline.model_refs import task_device
from solaris_jobs.pipeline.spark import spark_session
spark = spark_session("gpus", sys.argv[1], conf={"spark.executor.resource.gpu.amount": "2",
                                                  "spark.task.resource.gpu.amount": "1", "spark.executor.cores": "2"})

def devices(frames):
    import time
    import pandas as pd
    from pyspark import TaskContext
    for pdf in frames:
        ctx = TaskContext.get()
        t0 = time.time()
        time.sleep(3)                     # long enough that the two tasks of the stage run at the same time
        yield pd.DataFrame({"part": [ctx.partitionId()], "auto": [task_device("auto")],
                            "cuda": [task_device("cuda")], "cpu": [task_device("cpu")],
                            "assigned": [",".join(ctx.resources()["gpu"].addresses)], "t0": [t0],
                            "t1": [time.time()]})

rows = spark.range(8, numPartitions=2).mapInPandas(devices, "part int, auto string, cuda string, cpu string, "
                                                           "assigned string, t0 double, t1 double",
                                                   barrier=True).collect()      # both tasks launched together
print(json.dumps([r.asDict() for r in rows]))
"""


def test_each_task_runs_its_models_on_the_gpu_spark_assigned_it(tmp_path):
    """A standalone worker whose discovery script reports two (fake) GPUs, executors asking for both and tasks for
    one each: two tasks running at once each run on their own assigned GPU (``cuda:<address>``, not both on
    ``cuda:0``) for ``auto`` and ``cuda``, and an explicit ``cpu`` stays the CPU. Outside a task (no GPUs assigned) ``auto`` stays
    ``auto`` (CUDA if present, else the CPU: the CPU path unchanged)."""
    from solaris_jobs.pipeline.model_refs import task_device
    from tests.support import SparkStandalone
    with SparkStandalone(tmp_path / "cluster", gpus=("5", "7")) as cluster:
        res = subprocess.run([sys.executable, "-c", GPU_CLIENT, cluster.url], capture_output=True, text=True,
                             timeout=300, env=cluster.env())
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert sorted(r["part"] for r in rows) == [0, 1]
    a, b = rows
    assert max(a["t0"], b["t0"]) < min(a["t1"], b["t1"])                 # they ran at the same time
    assert {a["assigned"], b["assigned"]} == {"5", "7"}                   # on one GPU each
    for r in rows:
        assert r["auto"] == r["cuda"] == f"cuda:{r['assigned']}" and r["cpu"] == "cpu"
    assert task_device("auto") == "auto" and task_device("cuda:3") == "cuda:3"
