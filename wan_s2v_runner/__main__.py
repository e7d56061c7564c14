"""``python -m wan_s2v_runner``: the command line (:mod:`wan_s2v_runner.cli.main`)."""
from wan_s2v_runner.cli.main import entry

entry()
