"""RunSpec is the only description of a run setting: the CLI flags, their aliases, env defaults,
the TOML keys and the README flags table all come from the fields."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from wan_s2v_runner.cli import main as cli
from wan_s2v_runner.launcher import flags
from wan_s2v_runner.shared import config as spec_mod
from wan_s2v_runner.shared.config import env_values, load_toml
from wan_s2v_runner.shared.spec import RunSpec, flag_name, flag_of

README = Path(__file__).resolve().parent.parent / "README.md"


def _run_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def _option_dests(parser) -> dict[str, str]:
    return {s: a.dest for a in parser._actions for s in a.option_strings}


def test_every_field_is_a_flag_and_every_flag_a_field_or_command_option():
    opts = _option_dests(_run_parser())
    for name in RunSpec.model_fields:
        if not flag_of(name).cli:  # the environment's or TOML's alone
            assert flag_name(name) not in opts
            continue
        assert opts[flag_name(name)] == name
        for alias in flag_of(name).aliases:
            assert opts[alias] == name
    command = {o.dest for o in flags.COMMAND_OPTIONS} | {"help"}
    assert set(opts.values()) <= set(RunSpec.model_fields) | command


def test_flag_types_choices_and_defaults_come_from_the_field():
    p = _run_parser()
    acts = {a.dest: a for a in p._actions}
    assert acts["solver"].choices == ["unipc", "dpm++"]
    assert acts["mode"].choices == ["ulysses", "fsdp-fixed", "hybrid", "live", "auto"]
    assert acts["steps"].type is int and acts["shift"].type is float
    assert isinstance(acts["offload_model"], argparse.BooleanOptionalAction)
    assert all(a.default is None for a in p._actions if a.dest in RunSpec.model_fields)  # never overrides
    assert "(default: 40)" in acts["steps"].help and "[$MASTER_ADDR]" in acts["master_addr"].help


def test_aliases_and_size_parse_into_the_same_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = ["--ckpt-dir", "c", "--image", "i", "--audio", "a", "--prompt", "p"]
    a = cli.make_spec(_run_parser().parse_args(base + ["--size", "832*480", "--sample-steps", "7",
                                                       "--nproc-per-node", "2", "--save-file", "x.mp4"]))
    b = cli.make_spec(_run_parser().parse_args(base + ["--max-area", str(832 * 480), "--steps", "7",
                                                       "--nproc", "2", "--output", "x.mp4"]))
    assert a == b and a.max_area == 832 * 480 and a.steps == 7 and a.output == tmp_path / "x.mp4"


def test_toml_accepts_flag_spellings_and_rejects_unknown_keys(tmp_path):
    (tmp_path / "run.toml").write_text('[run]\nsize = "64*64"\nsample-steps = 3\npg_timeout = 5000\n'
                                       'nproc_per_node = 2\n')
    vals = load_toml(tmp_path / "run.toml")
    assert vals == {"max_area": "64*64", "steps": 3, "pg_timeout_s": 5000, "nproc": 2}
    assert RunSpec(ckpt_dir="c", image="i", audio="a", prompt="p", **vals).max_area == 64 * 64
    (tmp_path / "bad.toml").write_text('[run]\nstepz = 3\n')
    with pytest.raises(ValidationError) as e:
        RunSpec(ckpt_dir="c", image="i", audio="a", prompt="p", **load_toml(tmp_path / "bad.toml"))
    assert "unknown setting 'stepz'" in spec_mod.format_validation_error(e.value)


def test_env_defaults_are_declared_on_fields():
    env = {"MASTER_ADDR": "n0", "MASTER_PORT": "29600", "WORLD_SIZE": "2", "RANK": "1", "WAN_REPO": "/src/Wan2.2",
           "OTHER": "x"}
    vals = env_values(env)
    assert vals == {"master_addr": "n0", "master_port": 29600, "nnodes": 2, "node_rank": 1,
                    "wan_repo": Path("/src/Wan2.2")}
    assert env_values({"RANK": "not-a-number"}) == {}  # other tools' values are ignored


def test_errors_name_the_flag_users_type():
    with pytest.raises(ValidationError) as e:
        RunSpec(ckpt_dir="c", image="i", audio="a", prompt="p", pg_timeout_s=-1)
    text = spec_mod.format_validation_error(e.value)
    assert text.startswith("error: --pg-timeout: ") and "Fix: correct --pg-timeout." in text


def test_readme_flags_table_is_generated_from_the_fields():
    text = README.read_text(encoding="utf-8")
    assert flags.README_BEGIN in text and flags.README_END in text
    assert flags.replace_readme_block(text) == text, \
        "README flags table is stale: run `python -m wan_s2v_runner.launcher.flags --write README.md`"
    for name in RunSpec.model_fields:
        if flag_of(name).cli:
            assert f"`{flag_name(name)}" in text
        else:  # set by the environment or TOML only: neither in the table nor in --help (the whole flag:
            # --session is not, --session-idle is serve's)
            flag = re.escape(flag_name(name))
            assert not re.search(rf"`{flag}[ `]", text) and not re.search(rf"{flag}(?![\w-])", run_help())


def run_help() -> str:
    """``wan-s2v run --help``."""
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"].format_help()


def test_settings_without_a_flag_are_set_by_the_environment(monkeypatch):
    """The tests' switches (the rank worker, strict observers) have no flag: $WAN_S2V_RANK_WORKER and
    $WAN_S2V_STRICT_OBSERVERS set them, and a bad value names the variable to fix."""
    vals = env_values({"WAN_S2V_RANK_WORKER": "tests.stub_rank", "WAN_S2V_STRICT_OBSERVERS": "1"})
    spec = RunSpec(ckpt_dir="c", image="i", audio="a", prompt="p", **vals)
    assert (spec.rank_worker, spec.strict_observers) == ("tests.stub_rank", True)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "--rank-worker", "x"])
    with pytest.raises(ValidationError) as e:
        RunSpec(ckpt_dir="c", image="i", audio="a", prompt="p", rank_worker="not a module!")
    assert spec_mod.format_validation_error(e.value).startswith("error: $WAN_S2V_RANK_WORKER: ")
