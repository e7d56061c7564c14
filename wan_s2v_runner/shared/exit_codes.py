"""Exit codes of ``wan-s2v`` / ``run_s2v_multi_gpu.py`` (documented in README.md)."""
OK = 0
DOCTOR_FAILED = 1  # `wan-s2v doctor`: at least one check failed
USAGE = 2  # bad flags or an invalid run spec (one-line cause + fix printed)
PREFLIGHT = 3  # preflight refused the run; no rank was started
RANK_FAILED = 4  # a rank raised or died; its rank, stage and traceback are printed
HUNG = 5  # the hang watchdog fired; stacks dumped into the run directory
JOB_FAILED = 6  # `wan-s2v submit`: the server's job failed or was cancelled (its cause printed)
SERVER_UNREACHABLE = 7  # `wan-s2v submit`/`jobs`: no server at --url, or it answered with an error
FLEET_MISMATCH = 8  # `wan-s2v serve`: its weights or frame settings differ from its pool's (use --pool)
SHARED_DIR = 9  # `wan-s2v serve`: its shared directory is missing, read-only, or not the fleet's
DISK_FULL = 10  # a disk the run writes is full (or its quota spent): the committed clips kept; `wan-s2v resume`
INTERRUPTED = 130  # Ctrl-C (SIGINT) or SIGTERM; every rank was stopped

NAMES = {OK: "ok", DOCTOR_FAILED: "doctor-failed", USAGE: "usage", PREFLIGHT: "preflight-refused",
         RANK_FAILED: "rank-failed", HUNG: "hung", JOB_FAILED: "job-failed",
         SERVER_UNREACHABLE: "server-unreachable", FLEET_MISMATCH: "fleet-mismatch", SHARED_DIR: "shared-dir",
         DISK_FULL: "disk-full", INTERRUPTED: "interrupted"}
