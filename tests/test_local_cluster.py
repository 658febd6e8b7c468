"""Real tests against the private local Slurm cluster (vlaslurm.slurm.local_cluster).

They start the cluster at the default root (``$VLASLURM_LOCAL_SLURM`` or
/tmp/vlaslurm-local-slurm) and stop it afterwards only if it was not already
running, so a developer's running cluster is left alone.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlaslurm.slurm import local_cluster as lc

pytestmark = pytest.mark.slurm

if shutil.which("slurmctld") is None and not Path("/usr/sbin/slurmctld").exists():
    pytest.skip("slurm-wlm is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def cluster() -> lc.ClusterInfo:
    """The default-shape cluster; stopped at the end only if we started it."""
    was_running = lc.status().running
    info = lc.start()
    yield info
    if not was_running:
        lc.stop()


def _run(args: list[str], info: lc.ClusterInfo, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(info.env)
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=60, **kw)


def _wait_done(job_id: str, info: lc.ClusterInfo, timeout_s: float = 60) -> str:
    """Poll scontrol until the (het)job leaves PENDING/RUNNING; return its state."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = _run(["scontrol", "-o", "show", "job", job_id], info).stdout
        states = set(re.findall(r"JobState=(\S+)", out))
        if states and not states & {"PENDING", "RUNNING", "COMPLETING", "CONFIGURING"}:
            return ",".join(sorted(states))
        time.sleep(0.3)
    _run(["scancel", job_id], info)
    raise AssertionError(f"job {job_id} not done after {timeout_s}s")


def _sbatch(script: str, tmp_path: Path, info: lc.ClusterInfo) -> str:
    path = tmp_path / "job.sh"
    path.write_text(script)
    res = _run(["sbatch", "--parsable", str(path)], info, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().split(";")[0]


def test_status_and_idempotent_start(cluster: lc.ClusterInfo) -> None:
    st = lc.status()
    assert st.running and st.ready, st.describe()
    pids = dict(st.daemons)
    again = lc.start()
    assert again.slurm_conf == cluster.slurm_conf
    assert lc.status().daemons == pids, "a second start must not restart daemons"


def test_start_with_other_shape_while_running_is_refused(cluster: lc.ClusterInfo) -> None:
    with pytest.raises(lc.LocalClusterError, match="stop"):
        lc.start(shape=lc.ClusterShape(nodes=2))


def test_env_points_at_private_conf(cluster: lc.ClusterInfo) -> None:
    env = lc.env()
    assert env["SLURM_CONF"] == str(cluster.slurm_conf)
    assert not env["SLURM_CONF"].startswith("/etc/")
    conf = cluster.slurm_conf.read_text()
    assert f"socket={cluster.root}" in conf and "cred_expire=10" in conf


def test_cli_env_prints_exports(cluster: lc.ClusterInfo) -> None:
    repo = Path(__file__).resolve().parents[1]
    res = subprocess.run(
        [sys.executable, "-m", "vlaslurm.slurm.local_cluster", "env"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        cwd=repo,
    )
    assert f"export SLURM_CONF={cluster.slurm_conf}" in res.stdout


def test_sinfo_shows_nodes_and_partitions(cluster: lc.ClusterInfo) -> None:
    out = _run(["sinfo", "-h", "-N", "-o", "%N %P %T %c %G"], cluster).stdout
    rows = [line.split() for line in out.splitlines()]
    assert {r[0] for r in rows} == {"n0", "n1", "n2", "n3"}
    assert {r[1] for r in rows} == {"gpu*", "cpu", "gpu-inference"}
    assert all(r[3] == "32" and r[4].startswith("gpu:8") for r in rows), rows


def test_plain_job_runs(cluster: lc.ClusterInfo, tmp_path: Path) -> None:
    job = _sbatch(
        "#!/bin/bash\n#SBATCH --time=1 --gres=gpu:2 --output=out.txt\n"
        "srun --gres=gpu:2 bash -c 'echo node=$SLURMD_NODENAME cvd=$CUDA_VISIBLE_DEVICES'\n",
        tmp_path,
        cluster,
    )
    assert _wait_done(job, cluster) == "COMPLETED"
    assert re.search(r"node=n\d cvd=0,1", (tmp_path / "out.txt").read_text())


HETJOB = """#!/bin/bash
#SBATCH --time=2 --output=out.txt
#SBATCH --nodes=1 --ntasks=2 --cpus-per-task=4 --gres=gpu:8 --mem=64G
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1 --cpus-per-task=2 --gres=gpu:2 --mem=16G
#SBATCH hetjob
#SBATCH --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=1 --mem=4G --partition=cpu
show='echo "tag=$TAG node=$SLURMD_NODENAME cvd=$CUDA_VISIBLE_DEVICES"; sleep 3'
flags='--exact --ntasks=1 --cpus-per-task=4 --mem=8G'
TAG=a srun --het-group=0 $flags --gres=gpu:6 bash -c "$show" &
TAG=b srun --het-group=0 $flags --gres=gpu:2 bash -c "$show" &
TAG=c srun --het-group=1 --cpus-per-task=2 --mem=8G bash -c "$show" &
TAG=d srun --het-group=2 --cpus-per-task=1 --mem=1G bash -c "$show" &
wait
"""


def test_hetjob_components_see_own_gpus(cluster: lc.ClusterInfo, tmp_path: Path) -> None:
    job = _sbatch(HETJOB, tmp_path, cluster)
    assert _wait_done(job, cluster) == "COMPLETED"
    text = (tmp_path / "out.txt").read_text()
    seen = {
        m["tag"]: (m["node"], m["cvd"])
        for m in re.finditer(r"tag=(?P<tag>\w) node=(?P<node>\S+) cvd=(?P<cvd>\S*)", text)
    }
    assert set(seen) == {"a", "b", "c", "d"}, text
    gpus_a, gpus_b = set(seen["a"][1].split(",")), set(seen["b"][1].split(","))
    assert len(gpus_a) == 6 and len(gpus_b) == 2 and not gpus_a & gpus_b, text
    assert seen["a"][0] == seen["b"][0], "both steps run in component 0's node"
    assert seen["c"][1] == "0,1" and seen["c"][0] != seen["a"][0]
    assert seen["d"][1] == "", "cpu component has no GPUs"
    assert "step creation temporarily disabled" not in text, "steps a and b must overlap"


def test_stop_and_restart(cluster: lc.ClusterInfo) -> None:
    """stop leaves no daemon of ours; start brings the same cluster back."""
    lc.stop()
    st = lc.status()
    assert st.configured and not any(st.daemons.values()), st.describe()
    lc.start()
    assert lc.status().ready
