"""Which steps get the full proof: the verifier's compute as a fraction of the training's (--verify_budget).

The cheap proof (verifier/resume_proof.py) runs at every save that has a probe: k steps whatever the
interval. The full proof replays a whole interval, as much compute as the training it checks, so with
a budget b < 1 it is given to a sample of the saves: a save is due when the steps this process has
replayed in full, plus this proof's, stay within b times the step (so 0.25 proves about every fourth
interval, evenly spread). Always due: b >= 1 (every interval, the chain of trust back to the seed), the
run's final step, a save with no probe to check it by (the cheap proof cannot run there), a save whose cheap
proof failed (only the full proof tells a wrong checkpoint from a broken resume after it), and the save after
such a one (where the steps that diverged are).
"""


class ProofBudget:
    def __init__(self, budget: float):
        self.budget = budget
        self.spent = 0  # steps this process replayed in full proofs
        self._owed = False  # the save after a failed cheap proof gets the full one

    def full_due(self, step: int, distance: int, *, final: bool, has_probe: bool, cheap_failed: bool) -> bool:
        if self.budget >= 1.0 or final or not has_probe or cheap_failed or self._owed:
            self._owed = cheap_failed
            return True
        return self.spent + distance <= self.budget * step

    def replayed(self, steps: int) -> None:
        self.spent += steps

    def describe(self) -> str:
        return f"--verify_budget={self.budget:g}"
