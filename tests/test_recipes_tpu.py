"""The Cloud TPU recipe as a user runs it: `python -m launch.tpu.recipe` prints the validated
variables followed by launch/tpu/run.sh, and that text runs here with bash against a fake `gcloud`
that logs each argument list and plays the TPU's states, so the assertions are on what gcloud gets.
Bad input exits 2 with one line on stderr and prints nothing.
"""

import os
import pathlib
import re
import shlex
import subprocess

import pytest

from runtime import exit_codes
from tests import helpers
from tests.test_shellcheck import run_shellcheck

RUN_SH = pathlib.Path(helpers.REPO_ROOT, "launch", "tpu", "run.sh")
WORKDIR = "gs://ckpt-bucket/runs/run1"
IMAGE = "us-docker.pkg.dev/my-project/repo/ckpt:tpu"
PACKAGE = "jax-checkpoint-service[gcs] @ git+https://github.com/example/ckpt"
TPU_FLAGS = ["--project=my-project", "--zone=us-east5-a", "--tpu_name=ckpt-pod", "--accelerator_type=v5litepod-16",
             "--runtime_version=v2-alpha-tpuv5-lite", f"--workdir={WORKDIR}"]
TRAINER_ARGS = ["--mesh=data=16", "--steps=5000", "--save_every_steps=500", "--resume_from=latest"]

# What an unfilled template leaves behind: <PROJECT>, TODO, ${VAR}, a Python None, {field}.
PLACEHOLDER = re.compile(r"<[A-Za-z_][-A-Za-z0-9_ .]*>|\bTODO\b|FIXME|\$\{|\bNone\b|\{[a-z_]+\}")
FAKE_GCLOUD = pathlib.Path(helpers.REPO_ROOT, "tests", "fake_gcloud.sh")
_ASSIGNMENT = re.compile(r"([A-Z_]+)=(.*)")


def run_recipe(*flags: str, **env) -> subprocess.CompletedProcess:
    return helpers.run_module("launch.tpu.recipe", *TPU_FLAGS, *flags, timeout=60, **env)


def tpu_script(*flags: str, trainer_args=TRAINER_ARGS) -> str:
    """The --dry_run text, checked: the generated variables, then run.sh as checked in, valid bash."""
    result = run_recipe(*flags, "--", *trainer_args)
    assert result.returncode == 0, result.stderr
    body = RUN_SH.read_text().partition("\n")[2]  # less its #! line
    assert result.stdout.endswith("\n" + body)
    generated = result.stdout[:-len(body)]
    assert not PLACEHOLDER.search(generated), PLACEHOLDER.search(generated)
    syntax = subprocess.run(["bash", "-n"], input=result.stdout, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    return result.stdout


def script_variables(script: str) -> dict[str, str]:
    """The NAME=VALUE lines the recipe put before run.sh, as bash assigns them."""
    body_start = script.index(RUN_SH.read_text().partition("\n")[2])
    matches = (_ASSIGNMENT.fullmatch(line) for line in script[:body_start].splitlines())
    return {m[1]: "".join(shlex.split(m[2])) for m in matches if m}


def shell_words(text: str) -> list[str]:
    """Words as bash splits them, with operators such as ;, ), ||, > and & as words of their own."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def find(commands: list[list[str]], *prefix: str) -> list[list[str]]:
    return [c for c in commands if c[1:1 + len(prefix)] == list(prefix)]


def flag(command: list[str], name: str) -> str | None:
    values = [word.partition("=")[2] for word in command if word.startswith(f"--{name}=")]
    assert len(values) <= 1, f"--{name} given twice in {command}"
    return values[0] if values else None


def remote(command: list[str]) -> list[str]:
    """The words of a command run on a host over ssh (its --command)."""
    return shell_words(flag(command, "command"))


class FakeGcloud:
    """tests/fake_gcloud.sh as `gcloud` on PATH: its TPU runs the trainer exits it is given, one per run."""

    def __init__(self, tmp_path: pathlib.Path):
        bin_dir, self.state = tmp_path / "bin", tmp_path / "gcloud"
        bin_dir.mkdir()
        self.state.mkdir()
        (bin_dir / "gcloud").write_text(f'#!/bin/sh\nexec bash {shlex.quote(str(FAKE_GCLOUD))} "$@"\n')
        (bin_dir / "gcloud").chmod(0o755)
        (self.state / "argv").touch()
        self.env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_GCLOUD_DIR": str(self.state)}
        self.tmp_path = tmp_path

    def expect(self, trainer_exits: list[str], verifier_exit: int = 0) -> None:
        (self.state / "trainer").write_text("".join(f"{line}\n" for line in trainer_exits))
        (self.state / "verifier").write_text(str(verifier_exit))

    def commands(self) -> list[list[str]]:
        """Each gcloud call's arguments, in order, "gcloud" first."""
        return [["gcloud", *shlex.split(line)] for line in (self.state / "argv").read_text().splitlines()]

    def run_recipe(self, *flags: str) -> subprocess.CompletedProcess:
        """`python -m launch.tpu.recipe ... --nodry_run`."""
        return self._checked(run_recipe(*flags, "--nodry_run", "--", *TRAINER_ARGS, **self.env))

    def run_script(self, path: pathlib.Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """`bash run.sh` with only `env` (so nothing from this process's environment fills a gap)."""
        return self._checked(subprocess.run(["bash", str(path)], env={**(env or {}), **self.env},
                                            capture_output=True, text=True, timeout=60))

    def run_printed(self, *flags: str) -> list[list[str]]:
        """`--dry_run > run.sh && bash run.sh` through one successful run; the gcloud calls."""
        script = self.tmp_path / "run.sh"
        script.write_text(tpu_script(*flags))
        self.expect(["0"])
        result = self.run_script(script)
        assert result.returncode == exit_codes.OK, result.stderr
        return self.commands()

    def _checked(self, result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
        assert not any(line.startswith("fake gcloud") for line in result.stderr.splitlines()), result.stderr
        return result


@pytest.fixture
def fake_gcloud(tmp_path):
    return FakeGcloud(tmp_path)


def test_script_is_the_validated_variables_then_run_sh():
    script = tpu_script(f"--install={PACKAGE}", "--preemptible", "--max_restarts=7",
                        trainer_args=[*TRAINER_ARGS, "--log_every_steps=5"])
    variables = script_variables(script)
    assert variables["MAX_RESTARTS"] == "7" and variables["PREEMPTIBLE"] == "true" and variables["SPOT"] == "false"
    assert variables["INSTALL"] == PACKAGE and variables["IMAGE"] == ""
    assert shlex.split(variables["TRAINER_FLAGS"]) == [*TRAINER_ARGS, "--log_every_steps=5"]
    assert variables["VERIFIER_DEVICES"] == "4"
    # The exit codes the loop keys on come from runtime/exit_codes.py, never from numbers in run.sh.
    assert [int(variables[f"EXIT_{name}"]) for name in ("OK", "FAILURE", "BAD_INPUT", "PREEMPTED")] == [
        exit_codes.OK, exit_codes.FAILURE, exit_codes.BAD_INPUT, exit_codes.PREEMPTED]
    run_sh = RUN_SH.read_text()
    assert '"$code" -ne "$EXIT_PREEMPTED"' in run_sh and '"$restarts" -gt "$MAX_RESTARTS"' in run_sh
    assert not re.search(r"(\bexit|\bstop|-eq|-ne) +\"?[0-9]", run_sh)


def test_tpu_vm_script_puts_each_flag_in_its_command(fake_gcloud):
    commands = fake_gcloud.run_printed(f"--install={PACKAGE}", "--preemptible", "--max_restarts=7")
    assert all(flag(c, "project") == "my-project" and flag(c, "zone") == "us-east5-a" for c in commands)

    [create] = find(commands, "compute", "tpus", "tpu-vm", "create")
    assert create[5] == "ckpt-pod"
    assert flag(create, "accelerator-type") == "v5litepod-16"
    assert flag(create, "version") == "v2-alpha-tpuv5-lite"  # tpu-vm create names it --version
    assert "--preemptible" in create and "--spot" not in create
    assert find(commands, "compute", "tpus", "tpu-vm", "list")  # the state the restart loop reads

    install, train = find(commands, "compute", "tpus", "tpu-vm", "ssh")
    for ssh in (install, train):
        assert ssh[5] == "ckpt-pod" and "--worker=all" in ssh
    assert PACKAGE in remote(install) and "jax[tpu]" in remote(install)
    words = remote(train)
    start = words.index("trainer.train")
    assert words[start - 1:start + 6] == ["-m", "trainer.train", f"--workdir={WORKDIR}", *TRAINER_ARGS]
    assert "TPU_WORKER_HOSTNAMES" in flag(train, "command")  # what runtime/distributed.py reads
    assert not any("jax.distributed" in word or "--coordinator_address" in word for c in commands for word in c)

    [vm] = find(commands, "compute", "instances", "create")
    assert vm[4] == "ckpt-pod-verifier" and flag(vm, "machine-type") == "e2-standard-8"
    assert flag(vm, "scopes") == "cloud-platform"  # the verifier writes verdicts to the bucket
    verify = next(c for c in find(commands, "compute", "ssh") if "verifier.verify" in flag(c, "command"))
    words = remote(verify)
    start = words.index("verifier.verify")
    assert words[start + 1:start + 4] == [f"--workdir={WORKDIR}", "--mesh=data=4", "--follow"]
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=4" in words


def test_queued_resource_with_image_script(fake_gcloud):
    commands = fake_gcloud.run_printed(f"--image={IMAGE}", "--queued_resource", "--spot", "--verifier_vm=ckpt-check",
                                       "--verifier_machine_type=n2-standard-4", "--verifier_mesh=data=2")
    [create] = find(commands, "compute", "tpus", "queued-resources", "create")
    assert create[5] == "ckpt-pod" and flag(create, "node-id") == "ckpt-pod"
    assert flag(create, "accelerator-type") == "v5litepod-16"
    assert flag(create, "runtime-version") == "v2-alpha-tpuv5-lite"
    assert "--spot" in create
    assert not find(commands, "compute", "tpus", "tpu-vm", "create")

    install, train = find(commands, "compute", "tpus", "tpu-vm", "ssh")
    assert "--worker=all" in install and "--worker=all" in train
    assert remote(install)[-3:] == ["docker", "pull", IMAGE]
    words = remote(train)
    start = words.index(IMAGE)
    assert words[start:start + 7] == [IMAGE, "train", f"--workdir={WORKDIR}", *TRAINER_ARGS]
    assert "--privileged" in words and "TPU_WORKER_HOSTNAMES=$TPU_WORKER_HOSTNAMES" in " ".join(words)
    # A restart of this job is the same job to the workdir lease: it waits out the old lease.
    assert "JOB_ID=ckpt-pod" in " ".join(words) and "JOB_ID=$JOB_ID" in " ".join(words)

    [vm] = find(commands, "compute", "instances", "create")
    assert vm[4] == "ckpt-check" and flag(vm, "machine-type") == "n2-standard-4"
    verify = next(c for c in find(commands, "compute", "ssh", "ckpt-check") if IMAGE in flag(c, "command")
                  and "verify" in remote(c))
    words = remote(verify)
    start = words.index(IMAGE)
    assert words[start:start + 5] == [IMAGE, "verify", f"--workdir={WORKDIR}", "--mesh=data=2", "--follow"]
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=2" in words


def count(commands: list[list[str]], prefix: str, containing: str = "") -> int:
    calls = [" ".join(command[1:]) for command in commands]
    return sum(1 for call in calls if call.startswith(prefix) and containing in call)


@pytest.mark.parametrize("trainer_exits, verifier_exit, flags, code, creates, deletes, runs", [
    # preempted with its checkpoint committed, TPU still up: run again on the same TPU
    (["75", "0"], 0, [], 0, 1, 0, 2),
    # the spot TPU itself was taken (ssh lost): replace it, run again
    (["255 PREEMPTED", "0"], 0, [], 0, 2, 1, 2),
    # bad input with the TPU up: a restart would fail the same way
    (["2"], 0, [], exit_codes.BAD_INPUT, 1, 0, 1),
    (["1"], 0, [], exit_codes.FAILURE, 1, 0, 1),
    # preempted more often than allowed
    (["75", "75"], 0, ["--max_restarts=1"], exit_codes.PREEMPTED, 1, 0, 2),
    # the trainer finished but a verdict failed: the run's exit says so
    (["0"], 1, [], exit_codes.FAILURE, 1, 0, 1),
], ids=["preempted", "tpu-lost", "bad-input", "failure", "max-restarts", "verdict-failed"])
def test_restart_loop_against_fake_gcloud(fake_gcloud, trainer_exits, verifier_exit, flags, code, creates,
                                          deletes, runs):
    fake_gcloud.expect(trainer_exits, verifier_exit)
    result = fake_gcloud.run_recipe(f"--image={IMAGE}", "--spot", *flags)
    calls = fake_gcloud.commands()
    assert result.returncode == code, result.stderr
    assert count(calls, "compute tpus tpu-vm create ckpt-pod") == creates
    assert count(calls, "compute tpus tpu-vm delete ckpt-pod") == deletes
    assert count(calls, "compute tpus tpu-vm ssh ckpt-pod", "TPU_WORKER_HOSTNAMES") == runs
    assert count(calls, "compute tpus tpu-vm ssh ckpt-pod", "docker pull") == runs  # installed before each run
    assert count(calls, "compute instances create ckpt-pod-verifier") == 1
    assert count(calls, "compute ssh ckpt-pod-verifier", "--follow") == 1
    stopped = count(calls, "compute ssh ckpt-pod-verifier", "docker stop ckpt-verifier")
    assert stopped == (0 if trainer_exits[-1] == "0" else 1)  # a run that gives up stops its verifier


def test_suspended_queued_resource_is_replaced(fake_gcloud):
    fake_gcloud.expect(["255 SUSPENDED", "75", "0"])
    result = fake_gcloud.run_recipe(f"--image={IMAGE}", "--spot", "--queued_resource")
    calls = fake_gcloud.commands()
    assert result.returncode == 0, result.stderr
    assert count(calls, "compute tpus queued-resources create ckpt-pod") == 2
    assert count(calls, "compute tpus queued-resources delete ckpt-pod --force") == 1
    assert count(calls, "compute tpus tpu-vm ssh ckpt-pod", "TPU_WORKER_HOSTNAMES") == 3
    assert "restart 2 of 20" in result.stderr


def test_run_sh_refuses_a_missing_variable_before_any_gcloud_call(fake_gcloud):
    variables = script_variables(tpu_script(f"--image={IMAGE}"))
    assert len(variables) == 21
    for name in variables:
        result = fake_gcloud.run_script(RUN_SH, {n: v for n, v in variables.items() if n != name})
        assert result.returncode != 0 and f"{name} is not set" in result.stderr, (name, result.stderr)
        assert fake_gcloud.commands() == []
    result = fake_gcloud.run_script(RUN_SH, {**variables, "INSTALL": PACKAGE})
    assert result.returncode == exit_codes.BAD_INPUT
    assert result.stderr == "run.sh: set exactly one of IMAGE and INSTALL\n" and fake_gcloud.commands() == []


def test_printed_scripts_pass_shellcheck():
    for flags in ([f"--install={PACKAGE}", "--preemptible"], [f"--image={IMAGE}", "--queued_resource", "--spot"]):
        result = run_shellcheck("-", text=tpu_script(*flags))  # the variables, then run.sh
        assert result.returncode == 0, result.stdout + result.stderr


def test_nodry_run_without_gcloud_exits_2(tmp_path):
    result = run_recipe(f"--image={IMAGE}", "--nodry_run", PATH=str(tmp_path))
    assert result.returncode == exit_codes.BAD_INPUT
    assert result.stderr.strip() == "error: gcloud is not on PATH; use --dry_run to print the commands instead"


@pytest.mark.parametrize("flags, trainer_args, message", [
    ([f"--image={IMAGE}", "--workdir=/tmp/run"], [], "must be a gs://BUCKET/PATH"),
    ([f"--image={IMAGE}", "--workdir="], [], "--workdir is required"),
    ([f"--image={IMAGE}", "--tpu_name="], [], "--tpu_name is required"),
    ([f"--image={IMAGE}", "--tpu_name=Ckpt_Pod"], [], "--tpu_name='Ckpt_Pod'"),
    ([f"--image={IMAGE}", "--accelerator_type=v5lite"], [], "--accelerator_type='v5lite' is not valid"),
    ([f"--image={IMAGE}", "--project="], [], "--project is required"),
    ([f"--image={IMAGE}", "--zone=us-east5"], [], "--zone='us-east5' is not valid"),
    ([], [], "exactly one of --image and --install"),
    ([f"--image={IMAGE}", f"--install={PACKAGE}"], [], "exactly one of --image and --install"),
    (["--image=<IMAGE>"], [], "is not a container image"),
    ([f"--image={IMAGE}", "--spot", "--preemptible"], [], "at most one of --spot and --preemptible"),
    ([f"--image={IMAGE}", "--queued_resource", "--preemptible"], [], "not available for queued resources"),
    ([f"--image={IMAGE}", "--verifier_mesh=data=x"], [], "positive integer size"),
    ([f"--image={IMAGE}"], ["--workdir=gs://other/run"], "do not pass --workdir to the trainer"),
    ([f"--image={IMAGE}"], ["--num_processes=4"], "do not pass --num_processes"),
    ([f"--image={IMAGE}"], ["5000"], "must each be --name=value"),
    ([f"--image={IMAGE}"], ["--preemption_grace_secs=soon"], "--preemption_grace_secs='soon' is not a number"),
    ([f"--image={IMAGE}", "--max_restarts=-1"], [], "max_restarts"),
    ([f"--image={IMAGE}", "--zonee=us-east5-a"], [], "zonee"),
])
def test_tpu_bad_input_exits_2_with_one_line(flags, trainer_args, message):
    result = run_recipe(*flags, "--", *trainer_args)
    assert result.returncode == exit_codes.BAD_INPUT, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert result.stdout == ""
