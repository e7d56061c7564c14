from wan_s2v_runner.launcher.cli import entry

entry()
