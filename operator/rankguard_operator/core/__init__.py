"""The pure core: one reconcile step and everything it reads, in rooms by the loop's stages.

No I/O, no clock, no kopf, kubernetes or aiohttp here (the edge does those; import-linter holds
it, .importlinter). The rooms stack, each importing only rooms below it:

    step > status > policy > render | observe > budget > model > spec > engine > ground

ground is the loose modules here: units, names, conditions, effects, lease.
"""
