"""Shared vocabulary: what the launcher and the ranks both read, and nothing that runs a model.

The settings (:mod:`.spec`: a rank group's ``GroupSpec``, a job's ``JobSpec``, and ``RunSpec``,
both; validated once, written to ``spec.json``), a group's jobs (:mod:`.jobs`, ``jobs.jsonl``),
how a server hands jobs to its ranks (:mod:`.inbox`), the parallel layout, modes and the device
mesh with its ``MeshAxis`` names (:mod:`.layout`), stages (:mod:`.stages`), the event files ranks write and the launcher
reads (:mod:`.events`), exit codes (:mod:`.exit_codes`), the checkpoint's file names
(:mod:`.ckpt_layout`), where the engine is and which one (:mod:`.engine_source`), the attention
backends a machine has (:mod:`.attention_backends`), mp4 and audio (:mod:`.media`), clip
checkpoints (:mod:`.resume`), the cluster environment (:mod:`.slurm`), writes by temporary
name then rename (:mod:`.atomic`), and the caches on disk: where each lives (:mod:`.cache_dirs`), the
DiT cache's budget (:mod:`.cache_budget`) and files (:mod:`.dit_files`), all of them listed and
cleared (:mod:`.caches`).

May import: nothing else from the project.
"""
