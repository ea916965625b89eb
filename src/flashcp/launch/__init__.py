"""Launching and supervising jobs, above the trainer: `flashcp train` (`job`: `preflight`,
then `supervise`), one rank's entry (`worker`), and how ranks end (`outcome`)."""
