"""The workdir's listing of committed steps: on a local disk our own loop and Orbax's finalized test as plain calls
(Orbax runs it on a new event loop per step), which must give Orbax's own listing for every kind of entry a
checkpoints/ directory can hold."""

import os

import orbax.checkpoint as ocp

from checkpointing._src import workdir as workdir_lib


def test_the_local_listing_is_orbaxs_for_every_kind_of_entry(tmp_path):
    workdir = str(tmp_path)
    checkpoints = workdir_lib.checkpoints_dir(workdir)
    assert workdir_lib.committed_steps(workdir) == []  # no checkpoints/ yet
    for name in ("10", "2", "30.orbax-checkpoint-tmp-1700000000", "40.orbax-checkpoint-tmp", "ckpt_50",
                 "notastep", "7_tmp"):
        os.makedirs(checkpoints / name)
    (checkpoints / "60").write_text("a file, not a step directory")
    os.symlink(checkpoints / "10", checkpoints / "70")  # a link to a step directory
    os.symlink(checkpoints / "gone", checkpoints / "80")  # a dangling link
    listed = workdir_lib.committed_steps(workdir)
    assert listed == sorted(ocp.path.step.checkpoint_steps(checkpoints))
    assert listed == [2, 10, 50, 70]
    # The one-step answer a save's commit check uses agrees with it.
    assert [step for step in (2, 10, 30, 40, 60, 70, 80) if workdir_lib.is_committed(workdir, step)] == [2, 10, 70]
