"""wan-s2v: run the official Wan2.2 S2V engine (the ``wan`` package) on one or many GPUs, or a CPU.

The package is cut by who runs the code. Each folder's ``__init__`` says what lives there and,
on its ``May import:`` line, which other folders its modules may import (lazy imports inside
functions count too); ``tests/test_imports.py`` reads those lines and holds the tree to them.

* ``cli/`` -- the command line: flags, TOML and environment into a spec, handed to the launcher or
  the server.
* ``launcher/`` -- the user's process: spawning the node agent, supervision, the console, failure
  and hang verdicts, the run manifest, ``wan-s2v batch``.
* ``serve/`` -- ``wan-s2v serve``: the HTTP API, the queue, the keepers of its rank groups (through
  the launcher), the fleet, the status page; its terminal client.
* ``preflight/`` -- the launcher's checks before anything is spawned, and ``wan-s2v doctor``.
* ``demo/`` -- the tiny random-weight checkpoint and synthetic inputs of the demo and the tests.
* ``rank/`` -- one rank under the node agent: the worker, the generation loop, the rank's parallel plan.
* ``loading/`` -- the engine and its weights: importing ``wan``, reading checkpoint files, lean
  loading, LoRA merging, the parts a rank loads.
* ``vae_split/`` -- the engine's VAE split over ranks by rows of pixels (exact).
* ``shared/`` -- what both sides read: the run spec, the parallel layout, stages, events, exit
  codes, the checkpoint's file names, media, clip checkpoints.

Beside the package: ``runners/`` (one module per parallel mode, rank side) and ``patches/``
(named changes to the engine, applied at run time).
"""
