"""Launching and supervising jobs: `flashcp train` (`job`) and the run directory (`rundir`)."""
