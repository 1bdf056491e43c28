"""The process runtime: start-up, the once-per-step preemption decision, the watchdog, multi-host
agreement, exit codes, log setup and the one exit-code wrapper every entry point runs in.

The bottom layer: it imports nothing else of ours, and checkpointing, the trainer and the launchers
all build on it.
"""
