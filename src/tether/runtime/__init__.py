"""Where untrusted or remote work runs: the sandbox for model-written programs and the Ray helpers.

A neutral package below ``rollout`` (the ``python`` tool) and ``rewards`` (the code verifier): it knows
nothing about either, so both import it downward.
"""
