"""The process runtime under the trainer: start-up, the once-per-step preemption decision, the
watchdog, exit codes, log setup and the one exit-code wrapper every entry point runs in.

Below `trainer` and above `checkpointing`: it may use checkpointing's errors, never the trainer.
"""
