"""What tests/test_docs.py reads out of the README and docs/*.md: the names docs/api.md lists, the
commands the docs give with their flags, the code blocks of the sections marked as run, the links.

The matching is deliberately simple, and these are its rules:
- a command is `python -m <module>` anywhere (a code block or inline code; `.venv/bin/python -m`
  too), or `bash launch/demo.sh` (which passes its arguments to `launch.demo`); its flags are the
  `--name` words after it in the same command: up to the end of the line (a line ending in `\\`
  goes on), a backtick (inline code ends), `&&`, ` -- ` (a launcher passing the rest on), ` #` (a
  shell comment) or the next command;
- the names docs/api.md lists are the leading identifier of every backticked item in the first
  column of its tables whose first header is `name`, and every name of a `from checkpointing import`;
- a section is run when its `## ` heading is followed by a blank line and the marker comment
  `<!-- tests/test_docs.py runs ...`: every ```python block in it, up to the next `## ` heading;
- a shell command (tests/test_readme.py) is a line of a ```bash block, a line ending in `\\` joined
  with the next, a comment (a `#` starting a word outside quotes) and blank lines dropped.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_MARKER = "<!-- tests/test_docs.py runs"

COMMAND = re.compile(r"python -m ([A-Za-z_]\w*(?:\.\w+)+)|bash (launch/demo\.sh)")
SCRIPTS = {"launch/demo.sh": "launch.demo"}  # a script that runs a module with its own arguments
FLAG = re.compile(r"(?<![\w-])--([A-Za-z]\w*)")
ENDS = ("`", "&&", " -- ", " #")


def relative(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def joined_lines(text: str) -> list[str]:
    """The lines of `text`, a line ending in a backslash joined with the next (shell continuation)."""
    return re.sub(r"\\\n", " ", text).splitlines()


def documented_commands() -> dict[str, dict[str, set[str]]]:
    """{module: {flag name: the docs that give it}} for every `python -m module` in the docs."""
    commands: dict[str, dict[str, set[str]]] = {}
    for path in DOCS:
        for line in joined_lines(path.read_text()):
            matches = list(COMMAND.finditer(line))
            for i, match in enumerate(matches):
                end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
                words = line[match.end():end]
                for stop in ENDS:
                    words = words.split(stop)[0]
                flags = commands.setdefault(match.group(1) or SCRIPTS[match.group(2)], {})
                for name in FLAG.findall(words):
                    flags.setdefault(name, set()).add(relative(path))
    return commands


def help_flags(help_text: str) -> set[str]:
    """Every flag name an absl `--helpfull` lists (`--name`, `--[no]name`), and `noname` for a boolean."""
    names = set(re.findall(r"--(?:\[no\])?([A-Za-z]\w*)", help_text))
    booleans = re.findall(r"--\[no\]([A-Za-z]\w*)", help_text)
    return names | {f"no{name}" for name in booleans}


def api_names(text: str) -> dict[str, str]:
    """{name: module} of every name docs/api.md lists: a table headed `name` lists `checkpointing`'s
    (`Checkpointer`, `Checkpointer.on_step`, ...), one headed by a module's name (`checkpointing.errors`)
    that module's; and the names of every `from checkpointing import ...` of its code."""
    names = {}
    header = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        first = line.split("|")[1].strip()
        if header is None:
            header = "checkpointing" if first == "name" else first.strip("`") if first.startswith("`checkpointing.") \
                else ""
            continue
        if header and not set(first) <= set("-: "):
            names.update((name, header) for name in re.findall(r"`([A-Za-z_]\w*(?:\.\w+)?)", first))
    for parenthesized, line in re.findall(r"from checkpointing import (?:\(([^)]*)\)|([^\n]+))", text):
        names.update((name, "checkpointing") for name in re.findall(r"\w+", parenthesized or line.split("#")[0]))
    return names


def run_sections(path: pathlib.Path) -> list[tuple[str, list[tuple[int, str]]]]:
    """[(heading, [(line number, code)])] of every section of `path` marked to be run."""
    lines = path.read_text().splitlines()
    sections = []
    for number, line in enumerate(lines):
        if line.startswith("## ") and number + 2 < len(lines) and lines[number + 2].startswith(RUN_MARKER):
            sections.append((line[3:], python_blocks(lines, number + 1)))
    return sections


def python_blocks(lines: list[str], start: int) -> list[tuple[int, str]]:
    """The ```python blocks from line index `start` to the next `## ` heading, with their line numbers."""
    return fenced_blocks(lines, "python", start, section_only=True)


def fenced_blocks(lines: list[str], language: str, start: int = 0,
                  section_only: bool = False) -> list[tuple[int, str]]:
    """[(line number of its first code line, code)] of every ```<language> block from line index
    `start` (to the next `## ` heading if `section_only`)."""
    blocks, current, first = [], None, 0
    for number in range(start, len(lines)):
        line = lines[number]
        if current is None and section_only and line.startswith("## "):
            break
        if current is None and line.strip() == "```" + language:
            current, first = [], number + 2
        elif current is not None and line.strip() == "```":
            blocks.append((first, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def fence_languages(path: pathlib.Path) -> list[str]:
    """The language of every fenced block of `path` ("" for a plain one), in order."""
    return re.findall(r"^```(\S*)\n.*?^```$", path.read_text(), flags=re.S | re.M)


def shell_commands(code: str) -> list[str]:
    """The commands of a ```bash block: its lines, continuations joined, comments and blank lines dropped."""
    return [command for command in map(without_comment, joined_lines(code)) if command]


def readme_commands() -> list[tuple[int, str]]:
    """[(line number of its block, command)] of every shell command of README.md, in order."""
    lines = (ROOT / "README.md").read_text().splitlines()
    return [(number, command) for number, code in fenced_blocks(lines, "bash") for command in shell_commands(code)]


def without_comment(line: str) -> str:
    """`line` up to a `#` that starts a word outside quotes (a shell comment), trailing blanks dropped."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def local_links(path: pathlib.Path) -> list[tuple[str, str]]:
    """(target file, anchor or "") of every relative markdown link in `path`."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    links = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        links.append((file, anchor))
    return links
