"""The run: the training loop and its stage graph (``runner``), the executors that schedule rollout
against update (``executor``), checkpoints and resume, the SIGTERM/Ctrl-C handling, and the
per-GPU memory preflight. Only the CLI and the experiment tools import it.
"""
