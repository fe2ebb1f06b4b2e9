"""Requests, scheduler, runner and sampler (issue 4: not built yet)."""
