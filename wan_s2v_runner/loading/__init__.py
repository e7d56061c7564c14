"""Loading: the engine and its weights. :mod:`.engine` imports ``wan`` with the pre-import
patches; :mod:`.ckpt_tables` reads what checkpoint files hold without reading tensors (also used
by preflight); :mod:`.ckpt_read` reads byte ranges of them into tensors; :mod:`.lean_load` fills
models built on the meta device (FSDP shards, node-shared copies); :mod:`.lora` plans and merges
LoRAs; :mod:`.components` builds the engine parts a rank needs; :mod:`.venv_check` says whether
every module the engine and the runner import loads here (native libraries above all).

Modules here import torch only inside functions where preflight uses them (``ckpt_tables``,
``lora``, ``engine``), so the launcher can read checkpoint headers without it.

May import: shared, patches.
"""
