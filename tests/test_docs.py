"""The docs as a reference, checked against the code (the rules of what is read: tests/docs_text.py).

Fast: the README and docs/performance.md stay short; every relative link points at a file and a
heading that exist; every name docs/api.md lists imports from `checkpointing`. Slow: every command
the docs give prints its `--helpfull` with every flag the docs give it; the README's commands run as
written (fewer steps) from a directory of the user's; the code answering a new user's questions runs.
"""

import concurrent.futures
import importlib
import inspect
import os
import shlex
import subprocess
import sys

import pytest

from tests import docs_text, helpers

README_MAX_LINES = 150
PERFORMANCE_MAX_LINES = 300
LINE_MAX_CHARS = 300  # docs/performance.md: no run-log lines


def test_the_readme_and_the_performance_doc_stay_short():
    readme = (docs_text.ROOT / "README.md").read_text().splitlines()
    performance = (docs_text.ROOT / "docs" / "performance.md").read_text().splitlines()
    assert len(readme) <= README_MAX_LINES, f"README.md has {len(readme)} lines"
    assert len(performance) <= PERFORMANCE_MAX_LINES, f"docs/performance.md has {len(performance)} lines"
    long_lines = [number + 1 for number, line in enumerate(performance) if len(line) > LINE_MAX_CHARS]
    assert not long_lines, f"docs/performance.md lines over {LINE_MAX_CHARS} characters: {long_lines}"


DOCS_LINE_MAX_CHARS = 400  # a table cell of 1,400 characters is prose: write it as prose (or short rows)


def test_no_docs_line_is_a_wall_of_text():
    long_lines = [f"{docs_text.relative(path)}:{number + 1} ({len(line)} characters)" for path in docs_text.DOCS
                  for number, line in enumerate(path.read_text().splitlines()) if len(line) > DOCS_LINE_MAX_CHARS]
    assert not long_lines, f"lines over {DOCS_LINE_MAX_CHARS} characters:\n" + "\n".join(long_lines)


def test_api_md_describes_the_replay_tolerances_and_read_history_as_the_code_has_them():
    """api.md said a ReplayProgram has measured loss_rtol/state_rtol (verifier.md: none needed), and that
    read_history returns keys (it returns a History object)."""
    from checkpointing._src.history import History

    api = (docs_text.ROOT / "docs" / "api.md").read_text()
    assert "measured cross-layout tolerances" not in api and "No tolerance is needed" in api
    assert "`read_history(workdir) -> History`" in api and "`.losses`" in api
    assert {"losses", "attempts", "evals"} <= set(History.__dataclass_fields__)


def test_every_relative_link_points_at_a_file_and_a_heading_that_exist():
    broken = []
    for path in docs_text.DOCS:
        for file, anchor in docs_text.local_links(path):
            target = (path.parent / file).resolve() if file else path
            if not target.exists():
                broken.append(f"{docs_text.relative(path)}: {file} does not exist")
            elif anchor and target.suffix == ".md" and anchor not in docs_text.anchors(target):
                broken.append(f"{docs_text.relative(path)}: no heading #{anchor} in {file or path.name}")
    assert not broken, "\n".join(broken)


def test_every_name_docs_api_lists_imports_from_its_module():
    import checkpointing

    names = docs_text.api_names((docs_text.ROOT / "docs" / "api.md").read_text())
    assert {"Checkpointer", "CheckpointConfig", "Checkpointer.on_step", "Preempted"} <= set(names), sorted(names)
    assert set(checkpointing.__all__) <= set(names), "every public name has its row"
    assert {"checkpointing.config", "checkpointing.errors", "checkpointing.inspection",
            "checkpointing.verification"} <= set(names.values())
    missing = []
    for name, module_name in sorted(names.items()):
        head, _, attribute = name.partition(".")
        module = importlib.import_module(module_name)
        if module_name == "checkpointing" and head not in checkpointing.__all__:
            missing.append(f"{head}: not in checkpointing.__all__")
            continue
        if not hasattr(module, head):
            missing.append(f"{name}: {module_name} has no {head}")
            continue
        value = getattr(module, head)
        if attribute and not (hasattr(value, attribute) or f"self.{attribute} =" in inspect.getsource(value)):
            missing.append(f"{name}: {head} has no {attribute}")
    assert not missing, "docs/api.md lists names its modules do not have:\n" + "\n".join(missing)


def expected_help_exit(module: str) -> int:
    """0 under runtime/entry.py's run(main) (checkpointing.run_main's too); absl's own app.run exits 1 after
    printing the help."""
    source = (docs_text.ROOT / (module.replace(".", "/") + ".py")).read_text()
    return 0 if "entry.run(" in source or "run_main(" in source else 1


def helpfull(module: str) -> subprocess.CompletedProcess:
    return helpers.run_module(module, "--helpfull", timeout=120)


@pytest.mark.slow
def test_every_documented_command_prints_its_help_with_every_flag_the_docs_give_it():
    commands = docs_text.documented_commands()
    assert {"trainer.train", "trainer.inspect", "trainer.prepare", "verifier.verify", "verifier.calibrate",
            "launch.demo", "launch.local", "examples.own_loop"} <= set(commands), sorted(commands)
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip(commands, pool.map(helpfull, commands)))
    wrong = []
    for module, flags in sorted(commands.items()):
        result = results[module]
        if result.returncode != expected_help_exit(module) or "Traceback" in result.stderr:
            wrong.append(f"{module} --helpfull exited {result.returncode}:\n{result.stderr[-2000:]}")
            continue
        listed = docs_text.help_flags(result.stdout + result.stderr)
        for name, docs in sorted(flags.items()):
            if name not in listed:
                wrong.append(f"{module}: --{name} (in {', '.join(sorted(docs))}) is not in its --helpfull")
    assert not wrong, "\n".join(wrong)


# The README's commands, shortened: a flag in SHORTER replaces the value the README gives it (so a
# README command that stops saving along the way fails here); one in ADDED is added.
SHORTER = {"trainer.prepare": {"max_files": "20"},
           "trainer.train": {"steps": "4", "save_every_steps": "2", "eval_every_steps": "2"}}
ADDED = {"examples.own_loop": {"steps": "4", "save_every_steps": "2"}}


def readme_command_lines(*modules: str) -> list[str]:
    """The README's code lines that run `python -m` of each of `modules`, in the README's order."""
    lines = [line for _, line in docs_text.readme_commands() if any(f"python -m {m} " in line for m in modules)]
    assert lines, f"no README command runs {modules}"
    return lines


def shortened(command: str) -> list[str]:
    """argv of one README command (`python -m module --flag=value ...`): DIR a relative path, shortened."""
    words = [word.replace("DIR", "run") for word in shlex.split(command.split(" #")[0])]
    assert words[:2] == ["python", "-m"], command
    module, changes = words[2], SHORTER.get(words[2], {})
    argv = [sys.executable, "-m", module]
    for word in words[3:]:
        name = word[2:].split("=")[0]
        argv.append(f"--{name}={changes[name]}" if name in changes else word)
    return argv + [f"--{name}={value}" for name, value in ADDED.get(module, {}).items()]


def run_as_written(line: str, cwd) -> list[subprocess.CompletedProcess]:
    """Each `&&`-joined command of `line`, in `cwd`, stopping at the first that fails (as the shell does)."""
    results = []
    for command in line.split("&&"):
        results.append(subprocess.run(shortened(command.strip()), cwd=cwd, env=helpers.subprocess_env(),
                                      capture_output=True, text=True, timeout=300))
        if results[-1].returncode:
            break
    return results


@pytest.mark.slow
def test_the_readme_commands_run_as_written_from_a_directory_of_the_users(tmp_path):
    from checkpointing._src.workdir import committed_steps

    [corpus_line] = readme_command_lines("trainer.prepare")
    [own_loop_line] = readme_command_lines("examples.own_loop")
    for line, directory in ((corpus_line, tmp_path / "corpus"), (own_loop_line, tmp_path / "own")):
        directory.mkdir()
        results = run_as_written(line, directory)
        assert len(results) == line.count("&&") + 1 and not any(r.returncode for r in results), \
            "\n".join(f"{r.args[2]} exited {r.returncode}:\n{r.stderr[-3000:]}" for r in results)
    assert committed_steps(str(tmp_path / "corpus" / "runs" / "lm")) == [2, 4], "saves along the way and at the end"
    verdicts = sorted(os.listdir(tmp_path / "own" / "run" / "verdicts"))
    assert verdicts == ["2.json", "4.json"], verdicts


@pytest.mark.slow
@pytest.mark.parametrize("doc", ["docs/training.md", "docs/api.md"])
def test_the_answers_to_a_new_users_questions_run(doc, tmp_path):
    sections = docs_text.run_sections(docs_text.ROOT / doc)
    assert sections and all(blocks for _, blocks in sections), f"{doc}: no section marked to run"
    script = "\n\n".join(f"# {doc}, line {number}\n{code}" for _, blocks in sections for number, code in blocks)
    (tmp_path / "answers.py").write_text(script)
    result = subprocess.run([sys.executable, str(tmp_path / "answers.py")], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env=helpers.subprocess_env(TMPDIR=str(tmp_path)))
    assert result.returncode == 0, f"{doc}'s answers failed:\n{result.stderr[-4000:]}"
