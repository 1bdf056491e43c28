"""Models that live outside the trainer and plug in with --model=package.module:name."""
