"""Demo assets: a tiny random-weight checkpoint in the real Wan2.2-S2V file layout
(:mod:`.tiny_checkpoint`), a synthetic reference image and speech clip (:mod:`.synthetic_inputs`),
and the cached set ``wan-s2v demo`` and the tests use (:mod:`.assets`).

May import: shared, loading.
"""
