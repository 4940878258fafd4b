"""Layer 1, foundations: atomic writes, user-facing errors, config checks, export manifests and the prompt pool.

Nothing here knows a tool, a learner, a Lightning module or an environment.
"""
