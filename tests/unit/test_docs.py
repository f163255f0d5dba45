"""Links in README.md and docs/*.md stay inside the repository.

Relative links (markdown links, and paths in code that name a repository file such as
`scripts/slurm/local.sbatch`) must point to files that exist, never outside the
checkout; absolute URLs only to public upstream documentation.
"""

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Public upstream documentation: the only places a document may send a reader.
ALLOWED_HOSTS = {
    "docs.python.org", "slurm.schedmd.com", "docs.olcf.ornl.gov", "mpi4py.readthedocs.io",
    "pytorch.org", "huggingface.co", "lightning.ai", "docs.hdfgroup.org",
    "support.hdfgroup.org", "www.mpich.org", "openpbs.org", "www.deepspeed.ai",
    "docs.nvidia.com", "orbax.readthedocs.io", "docs.h5py.org", "numpy.org",
    "docs.scipy.org", "click.palletsprojects.com", "xxhash.com", "www.apache.org",
}
# Where a host also serves things that are not documentation, the path must be its docs.
ALLOWED_PREFIXES = {"pytorch.org": "/docs/", "huggingface.co": "/docs/",
                    "lightning.ai": "/docs/"}

# Top-level entries of the repository a path in a document may start with.
REPO_DIRS = ("cachex_agent", "scripts", "tests", "benchmarks", "examples", "docs")
REPO_FILES = ("README.md", "LICENSE", "Makefile", "pyproject.toml", "setup.cfg", "ruff.toml")

MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s)>\]`\"']+", re.IGNORECASE)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_DIRS, _FILES = "|".join(REPO_DIRS), "|".join(re.escape(f) for f in REPO_FILES)
# Any path that climbs with `../`, in a link or in prose ("see ../notes/x.md").
UP_PATH = re.compile(r"(?<![\w./-])((?:\.\./)+[\w.-][\w./-]*)")
REPO_PATH = re.compile(rf"(?<![\w$/.{{<-])((?:{_DIRS})/[\w./-]*|(?:{_FILES}))(?![\w/])")


def links(text: str) -> list[str]:
    return MD_LINK.findall(text) + REF_LINK.findall(text)


def urls(text: str) -> list[str]:
    return URL.findall(text)


# A relative file name in code that is not a placeholder (`<ckpt>.json`, `{node}`, `$X`,
# globs): `notes/mpi-rma.md`, `DESIGN.md`. It must name a file of the repository.
# A user's own file (`cachex.toml`, `train.py`) has no directory and is not markdown.
FILE_LIKE = re.compile(r"^(?![/~.])((?:[\w.-]+/)+[\w.-]+\.(md|py|sh|sbatch|pbs|toml|cfg)"
                       r"|[\w.-]+\.md)$")


def code_paths(text: str) -> list[str]:
    """Repository paths named in code spans and fenced blocks."""
    code = CODE_SPAN.findall(FENCE.sub("", text)) + FENCE.findall(text)
    named = [m.rstrip(".,:;") for chunk in code for m in REPO_PATH.findall(chunk)]
    words = [w.rstrip(".,:;") for chunk in code for w in chunk.split()]
    return named + [w for w in words if FILE_LIKE.match(w) and not REPO_PATH.fullmatch(w)]


def anchors(document: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", document.read_text())
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def problems_of(document: Path, text: str | None = None) -> list[str]:
    """What is wrong with the links of `document` (its text, unless given)."""
    text = document.read_text() if text is None else text
    found = [_up_problem(document, path) for path in UP_PATH.findall(text)]
    found = [problem for problem in found if problem]
    for url in urls(text):
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        prefix = ALLOWED_PREFIXES.get(host, "/")
        if parts.scheme != "https" or host not in ALLOWED_HOSTS \
                or not parts.path.startswith(prefix) and parts.path + "/" != prefix:
            found.append(f"{url}: not public upstream documentation")
    for target in links(text):
        if urlsplit(target).scheme or target.startswith("mailto:"):
            continue        # absolute: checked above
        found += _relative_problems(document, target)
    for path in code_paths(text):
        if not (ROOT / path).exists() and not (document.parent / path).exists():
            found.append(f"`{path}`: no such file in the repository")
    return found


def _up_problem(document: Path, path: str) -> str | None:
    resolved = (document.parent / path).resolve()
    if not resolved.is_relative_to(ROOT):
        return f"{path}: outside the repository"
    return None if resolved.exists() else f"{path}: no such file"


def _relative_problems(document: Path, target: str) -> list[str]:
    path, _, anchor = target.partition("#")
    resolved = (document.parent / path).resolve() if path else document
    if not resolved.is_relative_to(ROOT):
        return [f"{target}: outside the repository"]
    if not resolved.exists():
        return [f"{target}: no such file"]
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return [f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}"]
    return []


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda d: str(d.relative_to(ROOT)))
def test_links_stay_in_the_repository(document):
    assert problems_of(document) == []


def test_docs_exist_and_readme_is_short():
    assert len(DOCUMENTS) > 5
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160


@pytest.mark.parametrize("bad, expected", [
    ("as ../../design/notes.md says", "outside the repository"),
    ("[notes](notes/mpi-rma.md)", "no such file"),
    ("[up](../../etc/passwd)", "outside the repository"),
    ("see `scripts/slurm/nowhere.sbatch`", "no such file in the repository"),
    ("```\nsbatch scripts/slurm/gone.sbatch\n```", "no such file in the repository"),
    ("[blog](https://example.com/post)", "not public upstream documentation"),
    ("[torch home](https://pytorch.org/blog/x)", "not public upstream documentation"),
    ("[a](../README.md#no-such-heading)", "no heading"),
    ("see `notes/mpi-rma.md`", "no such file in the repository"),
    ("as `DESIGN.md` says", "no such file in the repository"),
    ("[a](configuration.md#keys) [b](https://docs.python.org/3/) `tests/nowhere/`",
     "no such file in the repository"),
])
def test_a_bad_link_is_caught(bad, expected):
    """The checker itself: each kind of bad link, as if in a document under docs/."""
    found = problems_of(ROOT / "docs" / "any.md", f"# t\n\n{bad}\n")
    assert any(expected in problem for problem in found), found


def test_good_links_pass():
    text = ("# t\n\n[readme](../README.md), [keys](configuration.md#keys),"
            " `scripts/slurm/local.sbatch`, `cachex_agent/config.py`, `<pfs>/<run>/ckpt`,"
            " `$CX_ROOT/scripts/lib`, [py](https://docs.python.org/3/library/os.html)\n")
    assert problems_of(ROOT / "docs" / "any.md", text) == []
