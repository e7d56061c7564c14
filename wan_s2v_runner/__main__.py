from wan_s2v_runner.cli import entry

entry()
