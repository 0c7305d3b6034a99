"""What simdist and the ``real`` launcher share that needs no simulator: torch and the standard library suffice.

``simdist``'s package imports the whole simulator (simpy, its torch hooks for one torch range), so the
launcher, which runs on GPU machines that may have neither, takes these from here. ``simdist.errors`` and
``simdist.script`` re-export them: a user names them through ``simdist``.
"""
