"""The whole job: rank classes, the layout search behind ``hyperdryrun fit``, exact reuse inside a step, executors.

``classes`` (which ranks provably share a memory profile), ``extrapolate`` (a step from a few small samples, checked
exactly), ``bounds`` (lower bounds on a rank's peak), ``roofline`` (step-time estimate), ``space`` (the candidate
layouts), ``cache`` (results on disk), ``executors`` (local processes, Ray), ``fit`` (the search itself).
"""
