"""The real verifier, recording its verdict writes (tests/test_verifier.py, tests/test_verifier_follow.py)."""

from verifier.verifier import Verifier


class RecordingVerifier(Verifier):
    """The real verifier, recording the order of its verdict writes as (step, complete), and how many
    step executables its replay programs had compiled at each."""

    def __init__(self, options):
        super().__init__(options)
        self.writes = []
        self.compiled_steps = []

    def _write(self, verdict):
        self.writes.append((verdict["step"], verdict["complete"]))
        self.compiled_steps.append(sum(program.step_fn._cache_size() for program in self._context.programs.values()))
        super()._write(verdict)
