"""``--pin-cpus``: which CPUs a CPU rank binds to (:func:`wan_s2v_runner.rank.cpu_binding.cpu_binding`).
The end-to-end binding (a 2-rank run's ``run.json`` ``ranks.N.cpus``) is asserted in test_parity."""
from __future__ import annotations

from wan_s2v_runner.cli import main as cli
from wan_s2v_runner.rank.cpu_binding import cpu_binding


def test_each_local_rank_gets_its_own_run_of_threads_cpus():
    allowed = [9, 2, 4, 6, 8, 3]  # an affinity mask need not start at 0 or be contiguous
    got = [cpu_binding(True, 2, r, 3, allowed) for r in range(3)]
    assert got == [[2, 3], [4, 6], [8, 9]]


def test_no_binding_when_the_ranks_need_more_cpus_than_allowed_or_when_off():
    assert cpu_binding(True, 2, 0, 2, [0, 1, 2]) is None  # 4 CPUs needed, 3 allowed
    assert cpu_binding(True, 1, 1, 3, [0, 1]) is None
    assert cpu_binding(False, 1, 0, 2, [0, 1, 2, 3]) is None
    assert cpu_binding(True, 1, 0, 1, [5, 7]) == [5]  # one rank: bound too (the same rule)


def test_the_flag_is_generated_from_the_spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = ["run", "--ckpt-dir", "ck", "--image", "i.png", "--audio", "a.wav", "--prompt", "p"]
    parse = cli.build_parser().parse_args
    assert cli.make_spec(parse(base)).pin_cpus is False  # off by default
    assert cli.make_spec(parse(base + ["--pin-cpus"])).pin_cpus is True
