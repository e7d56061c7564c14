"""The run spec: TOML < flags precedence, cluster env defaults, seed resolution, validation
errors that name the flag and a fix, and the per-mode layout everything else asks."""
from __future__ import annotations

import json

import pytest

from wan_s2v_runner.cli import main as cli
from wan_s2v_runner.launcher import spawn
from wan_s2v_runner.shared import exit_codes
from wan_s2v_runner.shared.spec import GroupSpec, Mode, RunSpec


def _args(argv):
    return cli.build_parser().parse_args(["run", *argv])


BASE = ["--ckpt-dir", "ck", "--image", "i.png", "--audio", "a.wav", "--prompt", "p", "--output", "o.mp4"]


def test_toml_supplies_and_flags_override(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "run.toml").write_text(
        '[run]\nckpt_dir = "ck"\nimage = "i.png"\naudio = "a.wav"\nprompt = "from toml"\n'
        'output = "o.mp4"\nsize = "832*480"\nmode = "hybrid"\nnproc = 4\nseed = 7\n')
    spec = cli.make_spec(_args(["--config", "run.toml", "--nproc", "2", "--prompt", "from flag"]))
    assert spec.prompt == "from flag" and spec.nproc == 2  # flags win
    assert spec.mode is Mode.HYBRID and spec.seed == 7 and spec.max_area == 832 * 480  # toml kept
    assert spec.ckpt_dir == tmp_path / "ck"  # paths made absolute


def test_cluster_env_defaults_below_flags(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "node0.cluster")
    monkeypatch.setenv("MASTER_PORT", "29600")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    spec = cli.make_spec(_args(BASE + ["--nproc", "8"]))
    assert (spec.master_addr, spec.master_port, spec.nnodes, spec.node_rank) == ("node0.cluster", 29600, 2, 1)
    assert spec.world_size == 16
    spec = cli.make_spec(_args(BASE + ["--master-port", "1234"]))
    assert spec.master_port == 1234


def test_seed_minus_one_is_chosen_once_by_the_launcher():
    spec = RunSpec(ckpt_dir="c", image="i", audio="a", prompt="p", output="o.mp4", nproc=2)
    assert spec.seed == -1
    a, b = spawn.finalize_spec(spec), spawn.finalize_spec(spec)
    assert a.seed >= 0 and b.seed >= 0 and a.seed != b.seed  # random per run...
    assert RunSpec.model_validate_json(a.to_json()).seed == a.seed  # ...and recorded for every rank
    assert a.master_port is None  # single node: the OS picks it at rendezvous (c10d on localhost:0)
    fixed = spawn.finalize_spec(spec.model_copy(update={"seed": 5}))
    assert fixed.seed == 5


@pytest.mark.parametrize("argv, flag, words", [
    (["--infer-frames", "7"], "--infer-frames", "multiple of 4"),
    (["--nnodes", "2", "--node-rank", "2"], "--spec", "node_rank 2 must be < nnodes 2"),
    (["--device", "cpu", "--attention", "fa2"], "--spec", "--attention sdpa"),
    (["--pg-timeout", "100"], "--spec", "must exceed the watchdog limits"),
    (["--steps", "0"], "--steps", "greater than 0"),
    (["--infer-frames", "4100"], "--infer-frames", "less than or equal to 4096"),  # the DiT's rotary table
    (["--cache", "easycache:x"], "--cache", "not a number from 0 to 10"),
    (["--steps", "40", "--shift", "50"], "--spec", "upstream's UniPC scheduler fails on that at its last step"),
    (["--load", "full", "--load-waves", "2"], "--spec", "--load-waves reads weights in turns under lean loading"),
])
def test_invalid_spec_exits_2_with_cause_and_fix(argv, flag, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = cli.main(["run", *BASE, "--runs-root", str(tmp_path / "runs"), *argv])
    err = capsys.readouterr().err
    assert code == exit_codes.USAGE
    assert words in err and "Fix:" in err
    assert len(err.strip().splitlines()) == 1  # one line per problem
    assert not (tmp_path / "runs").exists()  # nothing spawned, no run directory


def test_missing_required_flag_names_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = cli.main(["run", "--image", "i.png", "--audio", "a.wav", "--prompt", "p"])
    assert code == exit_codes.USAGE
    assert "--ckpt-dir is required" in capsys.readouterr().err


def test_layout_per_mode():
    kw = dict(ckpt_dir="c", image="i", audio="a", prompt="p", output="o.mp4", nproc=4)
    u, f, h = (RunSpec(**kw, mode=m).layout for m in ("ulysses", "fsdp-fixed", "hybrid"))
    assert (u.use_sp, u.dit_fsdp, u.t5_fsdp, u.t5_cpu, u.ulysses_degree) == (True, False, False, False, 4)
    assert (f.use_sp, f.dit_fsdp, f.t5_fsdp, f.t5_cpu, f.ulysses_degree) == (False, True, True, False, 1)
    assert (h.use_sp, h.dit_fsdp, h.t5_fsdp, h.t5_cpu, h.ulysses_degree) == (True, True, False, True, 4)
    assert RunSpec(**{**kw, "nproc": 1}).layout.use_sp is False  # one rank: plain engine path


def test_the_agent_gets_an_argument_list(tmp_path):
    spec = spawn.finalize_spec(RunSpec(ckpt_dir="c", image="i", audio="a", prompt="p",
                                        output=tmp_path / "it's a \"file\".mp4", nproc=2))
    argv = spawn.agent_argv(tmp_path / "run dir")
    assert argv[1:3] == ["-m", "wan_s2v_runner.rank.agent"] and spec.nproc == 2
    assert argv[-1] == str(tmp_path / "run dir" / "spec.json")  # one element, spaces and all
    assert spawn.agent_argv(tmp_path / "run dir", wait=True)[3] == "--wait"


def test_a_slurm_step_supplies_the_nodes_and_explicit_variables_win():
    """srun --nodes 2 --ntasks-per-node 1: node count, this node's index (its host in the step's
    node list) and the rendezvous host (the first node); MASTER_ADDR/WORLD_SIZE/RANK and flags
    override; an salloc shell (no step variables) is one node."""
    from wan_s2v_runner.shared.config import env_values
    from wan_s2v_runner.shared.slurm import expand_hostlist

    assert expand_hostlist("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert expand_hostlist("r[1-2]-n[8-9]") == ["r1-n8", "r1-n9", "r2-n8", "r2-n9"]
    step = {"SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURMD_NODENAME": "gpu08",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "5"}
    assert env_values(step) == {"nnodes": 2, "node_rank": 1, "master_addr": "gpu07"}
    assert env_values({**step, "MASTER_ADDR": "10.0.0.1", "RANK": "0"})["master_addr"] == "10.0.0.1"
    assert env_values({**step, "SLURMD_NODENAME": "elsewhere", "SLURM_NODEID": "1"})["node_rank"] == 1
    assert env_values({**step, "SLURMD_NODENAME": "elsewhere"}) == {}  # node 5 of the job, not of the step
    assert env_values({"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}) == {}  # salloc: not a step
    spec = RunSpec(**{**env_values(step), "ckpt_dir": "c", "image": "i", "audio": "a", "prompt": "p", "nproc": 4})
    assert (spec.world_size, spec.writes_output, list(spec.node_ranks(1))) == (8, False, [4, 5, 6, 7])


def test_mode_auto_applies_the_recommended_cfg_split_unless_the_flag_is_given(capsys):
    """--mode auto takes the doctor's plan: at 2 CPU ranks the CFG split (the same compute as
    Ulysses 2, without its all-to-alls); --no-cfg-parallel / --cfg-parallel are kept as given."""
    spec = cli.make_spec(_args(BASE + ["--mode", "auto", "--nproc", "2", "--device", "cpu"]))
    assert spec.mode is Mode.ULYSSES and spec.cfg_parallel
    assert "--mode auto: ulysses --cfg-parallel" in capsys.readouterr().err
    spec = cli.make_spec(_args(BASE + ["--mode", "auto", "--nproc", "2", "--device", "cpu", "--no-cfg-parallel"]))
    assert not spec.cfg_parallel
    spec = cli.make_spec(_args(BASE + ["--mode", "auto", "--nproc", "3", "--device", "cpu"]))
    assert not spec.cfg_parallel and spec.layout.sp_degree == 3  # odd: no CFG split
    # a batch's or a server's group, before any job: the same choice at the jobs' default size
    group = cli.make_group(cli.spec_values(_args(BASE + ["--mode", "auto", "--nproc", "2", "--device", "cpu"])))
    assert type(group) is GroupSpec and group.mode is Mode.ULYSSES and group.cfg_parallel
    assert "--mode auto: ulysses --cfg-parallel" in capsys.readouterr().err


# ----- the two sections: a rank group's settings and a job's
def test_group_and_job_are_two_models_and_a_run_is_both():
    from wan_s2v_runner.shared.spec import FlagGroup, GroupSpec, JobSpec, flag_of

    group_fields, job_fields = set(GroupSpec.model_fields), set(JobSpec.model_fields)
    assert not group_fields & job_fields and group_fields | job_fields == set(RunSpec.model_fields)
    for name in RunSpec.model_fields:  # every help section belongs to one of the two models
        assert flag_of(name).group.job == (name in job_fields), (name, flag_of(name).group)
    assert {flag_of(n).group for n in job_fields} == {g for g in FlagGroup if g.job}

    spec = RunSpec(ckpt_dir="ck", image="i.png", audio="a.wav", prompt="p", nproc=2, cfg_parallel=True)
    group, job = spec.group, spec.job
    assert type(group) is GroupSpec and type(job) is JobSpec
    assert RunSpec.of(group, job) == spec and group.world_size == 2 and job.speech == spec.audio
    # each validates its own rules; the rule across the two is the run's
    with pytest.raises(ValueError, match="multiple of 4"):
        JobSpec(image="i.png", audio="a.wav", prompt="p", infer_frames=6)
    with pytest.raises(ValueError, match="node_rank"):
        GroupSpec(ckpt_dir="ck", node_rank=1)
    with pytest.raises(ValueError, match="unknown|extra"):
        JobSpec(image="i.png", audio="a.wav", prompt="p", nproc=4)  # a group setting is not a job's
    with pytest.raises(ValueError, match="no unconditional pass"):
        RunSpec.of(group, job.model_copy(update={"guide_scale": 1.0}))


def test_spec_json_reads_as_a_group_or_as_a_run(tmp_path):
    from wan_s2v_runner.shared.spec import GroupSpec, read_spec

    spec = RunSpec(ckpt_dir="ck", image="i.png", audio="a.wav", prompt="p", seed=3)
    (tmp_path / "run.json").write_text(spec.to_json())  # a run (and every run directory before the split)
    (tmp_path / "group.json").write_text(spec.group.to_json())  # a batch's or a server's group
    assert read_spec(tmp_path / "run.json") == spec
    got = read_spec(tmp_path / "group.json")
    assert type(got) is GroupSpec and got == spec.group
    assert spawn.finalize_spec(got) == got  # a group has no seed to resolve


def test_spec_json_records_where_the_jobs_come_from_and_older_ones_are_read_as_before(tmp_path):
    """The launcher's choice of job source is in spec.json beside the spec (the spec reads as
    before); a spec.json from before the record has its source read from the files, as then."""
    from wan_s2v_runner.shared import inbox
    from wan_s2v_runner.shared.job_source import SPEC_KEY, JobSource, read_source, write_spec
    from wan_s2v_runner.shared.jobs import JOBS_FILE
    from wan_s2v_runner.shared.spec import read_spec

    spec = RunSpec(ckpt_dir="ck", image="i.png", audio="a.wav", prompt="p", seed=3)
    for source, written in ((JobSource.RUN, spec), (JobSource.LIST, spec.group), (JobSource.INBOX, spec.group)):
        d = tmp_path / source.value
        d.mkdir()
        write_spec(d, written, source)
        assert json.loads((d / "spec.json").read_text())[SPEC_KEY] == source.value
        assert read_source(d) is source and read_spec(d / "spec.json") == written
    (tmp_path / "run").joinpath(JOBS_FILE).write_text("")  # a file the source does not name changes nothing
    assert read_source(tmp_path / "run") is JobSource.RUN

    old = tmp_path / "old"
    old.mkdir()
    (old / "spec.json").write_text(spec.group.to_json())
    (old / JOBS_FILE).write_text("")
    assert read_source(old) is JobSource.LIST
    inbox.inbox_of(old).mkdir()
    assert read_source(old) is JobSource.INBOX
    (old / "spec.json").write_text(spec.to_json())
    (old / JOBS_FILE).unlink()
    inbox.inbox_of(old).rmdir()
    assert read_source(old) is JobSource.RUN


def test_resume_of_a_group_run_directory_says_how_to_resume_it(tmp_path, capsys):
    """A batch's or a server's run directory holds a group spec: `resume` is for one run."""
    spec = RunSpec(ckpt_dir="ck", image="i.png", audio="a.wav", prompt="p")
    (tmp_path / "spec.json").write_text(spec.group.to_json())
    assert cli.main(["resume", str(tmp_path)]) == exit_codes.USAGE
    err = capsys.readouterr().err
    assert "rank group of several jobs" in err and "Fix: run the same `wan-s2v batch` command again" in err
