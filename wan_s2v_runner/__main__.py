"""``python -m wan_s2v_runner``: the command line (:mod:`wan_s2v_runner.launcher.cli`)."""
from wan_s2v_runner.launcher.cli import entry

entry()
