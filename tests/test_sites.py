"""Site profiles: defaults under the spec with the site file's lines, lookup, GPU spelling, policy."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import REPO, vlaslurm

from vlaslurm.slurm.render import RenderOptions, render_script
from vlaslurm.spec import SpecError, load_spec
from vlaslurm.spec.plan import build_plan
from vlaslurm.spec.sites import PACKAGE_SITES, available_sites, load_site, site_additions

SPECS = REPO / "tests" / "specs"
LOCAL = PACKAGE_SITES / "local.yaml"
EXAMPLE = PACKAGE_SITES / "example-gpu-cluster.yaml"

MINI = """\
name: mini
env: {type: synthetic, num_envs: 4}
model: {type: synthetic}
algo: {type: synthetic}
resources:
  simulator: {gpus_per_node: 0}
  generator: {gpus_per_node: 1, gpu_type: h100}
  trainer: {gpus_per_node: 2, gpu_type: h100}
"""


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.fixture
def mini(tmp_path: Path) -> Path:
    path = tmp_path / "mini.yaml"
    path.write_text(MINI)
    return path


def site_file(tmp_path: Path, text: str, name: str = "mysite") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def render(loaded) -> str:
    return render_script(loaded, build_plan(loaded), RenderOptions(run_dir=Path("/runs/x/1"), python="/py"))


def test_shipped_sites_load_and_render_valid_bash(mini: Path, tmp_path: Path) -> None:
    assert {"local", "example-gpu-cluster"} <= set(available_sites())
    for site in ("local", "example-gpu-cluster"):
        script = tmp_path / f"{site}.sbatch"
        script.write_text(render(load_spec(mini, site=site)))
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_site_values_lie_under_the_spec_with_their_own_lines(mini: Path) -> None:
    loaded = load_spec(mini, site="local")
    assert loaded.spec.slurm.partition == "gpu" and loaded.spec.slurm.time == "00:10:00"
    assert str(loaded.where("slurm.time")) == f"{LOCAL}:{line_of(LOCAL, 'time:')}"
    added = {key: (value, str(where)) for key, value, where in site_additions(loaded)}
    assert added["slurm.partition"] == ("gpu", f"{LOCAL}:{line_of(LOCAL, 'partition: gpu')}")
    assert "env.num_envs" not in added and str(loaded.where("env.num_envs")).startswith(str(mini))


def test_spec_and_overrides_win_over_the_site(mini: Path) -> None:
    spec = mini.read_text() + 'slurm: {time: "00:03:00"}\n'
    mini.write_text(spec)
    loaded = load_spec(mini, ["runtime.first_meeting_timeout_s=30"], site="local")
    assert loaded.spec.slurm.time == "00:03:00" and str(loaded.where("slurm.time")).startswith(str(mini))
    assert loaded.spec.runtime.first_meeting_timeout_s == 30
    assert loaded.spec.slurm.partition == "gpu"  # a key the spec did not write still comes from the site
    keys = {key for key, _, _ in site_additions(loaded)}
    assert "slurm.time" not in keys and "runtime.first_meeting_timeout_s" not in keys and "slurm.partition" in keys


def test_a_bad_site_default_is_reported_at_the_site_file(mini: Path, tmp_path: Path) -> None:
    site = site_file(tmp_path, "description: x\ndefaults:\n  slurm:\n    time: forever\n")
    with pytest.raises(SpecError) as err:
        load_spec(mini, site=site)
    assert err.value.key == "slurm.time" and str(err.value.location) == f"{site}:4"


def test_a_mistyped_site_field_names_its_key_and_line(tmp_path: Path) -> None:
    site = site_file(tmp_path, "partitions:\n  gpu:\n    cpus: many\n")
    with pytest.raises(SpecError) as err:
        load_site(site)
    assert err.value.key == "partitions.gpu.cpus" and str(err.value.location) == f"{site}:3"
    site = site_file(tmp_path, "exclusiv: gpu\n", name="typo")
    with pytest.raises(SpecError, match="did you mean: exclusive") as err:
        load_site(site)
    assert str(err.value.location) == f"{site}:1"


def test_unknown_site_lists_the_known_ones(mini: Path) -> None:
    with pytest.raises(SpecError, match=r"no site 'locl'.*sites: .*local.*did you mean: local"):
        load_spec(mini, site="locl")


def test_user_config_folder_comes_first_and_env_selects(mini: Path, tmp_path: Path) -> None:
    sites = tmp_path / "config" / "vlaslurm" / "sites"
    sites.mkdir(parents=True)
    (sites / "local.yaml").write_text("defaults:\n  slurm: {partition: cpu}\n")
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config"), "VLASLURM_SITE": "local"}
    proc = vlaslurm("plan", str(mini), runs_root=tmp_path / "runs", env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"site local ({sites / 'local.yaml'})" in proc.stdout and "--partition=cpu" in proc.stdout
    off = vlaslurm("plan", str(mini), "--site", "none", runs_root=tmp_path / "runs", env=env)
    assert off.returncode == 0 and "site local" not in off.stdout and "--partition" not in off.stdout


def test_plan_shows_what_the_site_added(mini: Path, tmp_path: Path) -> None:
    proc = vlaslurm("plan", str(mini), "--site", "local", runs_root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"added   slurm.partition = 'gpu'  ({LOCAL}:" in proc.stdout
    assert "setup   export VLASLURM_SITE_NAME=local" in proc.stdout
    assert "fits    every component fits the site's node shapes" in proc.stdout


def test_gpu_type_is_spelt_the_sites_way(mini: Path) -> None:
    local = render(load_spec(mini, site="local"))  # constraint, untyped gres
    assert local.count("#SBATCH --constraint=h100") == 2 and "#SBATCH --gres=gpu:2\n" in local
    example = render(load_spec(mini, site="example-gpu-cluster"))  # typed gres as well
    assert "#SBATCH --gres=gpu:h100:2\n" in example and "#SBATCH --gres=gpu:h100:1\n" in example
    assert "--gres=gpu:2 --mem=0" in example  # steps ask for plain counts inside the typed allocation
    plain = render(load_spec(mini))  # no site: the type is the constraint
    assert plain.count("#SBATCH --constraint=h100") == 2 and "gpu:h100" not in plain


def test_gpu_type_and_partition_must_exist_on_the_site(mini: Path) -> None:
    with pytest.raises(SpecError, match=r"no GPU type 'h10'.*did you mean: h100") as err:
        load_spec(mini, ["resources.trainer.gpu_type=h10"], site="local")
    assert err.value.key == "resources.trainer.gpu_type" and str(err.value.location) == "command line"
    with pytest.raises(SpecError, match=r"no partition 'gpus'.*did you mean: gpu") as err:
        load_spec(mini, ["slurm.partition=gpus"], site="local")
    assert err.value.key == "slurm.partition"


def test_exclusive_policy_setup_lines_and_scratch(mini: Path) -> None:
    text = render(load_spec(mini, ['slurm.setup=["echo spec"]'], site="example-gpu-cluster"))
    header = text.split("\nset -uo pipefail")[0]
    components = header.split("#SBATCH hetjob")
    assert ["--exclusive" in c for c in components] == [False, True, True]  # policy gpu: only GPU components
    body = text.split("# --- setup lines from the spec, verbatim ---\n")[1].split("# --- end of setup ---")[0]
    lines = body.splitlines()
    assert lines[1:3] == ["module purge", "module load cuda/12.4 nccl/2.21"] and lines[-1] == "echo spec"
    assert any(line.startswith("export VLASLURM_SCRATCH=") for line in lines)
    assert "#SBATCH --account=my-project" in text and "#SBATCH --qos=normal" in text


def test_plan_says_when_the_sites_nodes_are_too_small(mini: Path, tmp_path: Path) -> None:
    proc = vlaslurm("plan", str(mini), "resources.trainer.gpus_per_node=16", "--site", "local", runs_root=tmp_path)
    assert proc.returncode == 0 and "DOES NOT FIT the site's node shapes" in proc.stdout


def test_site_runs_root_is_the_default(mini: Path, tmp_path: Path) -> None:
    site = site_file(tmp_path, f"runs_root: {tmp_path}/scratch-runs\n")
    proc = vlaslurm("plan", str(mini), "--site", str(site), env={"VLASLURM_RUNS_ROOT": ""})
    assert proc.returncode == 0, proc.stderr
    assert f"{tmp_path}/scratch-runs/mini/<date>-<time>" in proc.stdout


def test_no_site_changes_nothing() -> None:
    for spec in sorted(SPECS.glob("probe-*.yaml")):
        assert load_spec(spec, site=None).site is None
