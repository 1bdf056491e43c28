"""The service's interior: private. Users and our own tools reach it only through `checkpointing`,
`checkpointing.config`, `checkpointing.errors`, `checkpointing.inspection` and
`checkpointing.verification` (tests/test_layers.py)."""
