"""Experiments on top of the run: paper recipes with claim cards (``recipes``), the sweep summary
callback (``sweep``) and the supervised warm start for agents (``warmstart``).
"""
