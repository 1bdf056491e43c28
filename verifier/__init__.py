"""The verifier: a separate, read-only process that proves every committed checkpoint of a run on
its own mesh (verifier/verify.py is its entry point). Above the trainer: it replays any run through
the protocol in verifier/program.py, our trainer's and a user's own loop's alike.
"""
