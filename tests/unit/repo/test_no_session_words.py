"""No tracked file talks about the project's own development: a measurement is named by its date,
commit, machine and command, never by the work session that made it. Every tracked text file is
read (docs, comments, help strings, tests, JSON notes, logs), and every result file's name.

A process, Slurm or pytest session is another thing and passes: `start_new_session`, `setsid`,
`scope="session"`, "once per session", "this pytest session", "sessions of their own"."""

import re
import subprocess

from tests.conftest import REPO

# A development session: numbered ("session" or "sessions" then a number, with a space, "-" or "_"
# or nothing between), pointed at ("this", "that", "last", "previous", "prior", "earlier", "later",
# "next" right before "session"), or used as a time ("since"/"until" right before it; "ago",
# "before", "later", "earlier" right after it).
SESSION_WORDS = re.compile(
    r"\bsessions?[ _-]?\d"
    r"|\b(?:this|that|last|previous|prior|earlier|later|next) sessions?\b"
    r"|\b(?:since|until) sessions?\b"
    r"|\bsessions? (?:ago|before|later|earlier)\b",
    re.IGNORECASE,
)
# A file name tagged by a session: the word itself, or "s" and a number between underscores, dots
# or the ends of the name (`sft_h200x2_1b_s4.json`; `seed1`, `s3_upload` and `h200x2` pass).
NAME_TAG = re.compile(r"session|(?:^|_)s\d+(?:[_.]|$)", re.IGNORECASE)

W = "session"  # the examples below are built, so that this file holds no literal session words


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def test_the_patterns_catch_session_words_and_pass_process_sessions():
    for text in (
        f"since {W} 28",
        f"the {W}-23 plan",
        f"Earlier {W}s counted",
        f"{W}s 1-4 measured",
        f"measured in this {W}",
        f"(8 B: {W} 4's)",
        f"two {W}s ago",
        f"Until {W} 26 it left",
    ):
        assert SESSION_WORDS.search(text), text
    for text in (
        "start_new_session=True",
        '@pytest.fixture(scope="session")',
        "pytest_sessionfinish(session, exitstatus)",
        "built once per session by the first test",
        "every xdist worker of this pytest session shares",
        "torchrun puts its workers in sessions of their own",
        "a Slurm session on the login node",
        'msg["sessionId"] = self.session',
    ):
        assert not SESSION_WORDS.search(text), text
    assert NAME_TAG.search("sft_h200x2_1b_s4_call1.json") and NAME_TAG.search(f"sft_h200x2_{W}_end.md")
    for name in ("sft_h200x2_1b_20261130T2303_call1.json", "continue_cpu2_20261205_seed1.json", "h200x2"):
        assert not NAME_TAG.search(name), name


def test_no_tracked_file_names_or_mentions_a_development_session():
    files = tracked()
    assert "README.md" in files and "bench/README.md" in files
    results = [p for p in files if p.startswith("bench/results/")]
    assert len(results) > 100  # the committed measurements, named by date, machine and variant
    bad_names = [p for p in results if NAME_TAG.search(p.rsplit("/", 1)[-1])]
    found = []
    for path in files:
        data = (REPO / path).read_bytes() if (REPO / path).is_file() else b""
        if b"\0" in data[:8192]:
            continue  # binary (compressed traces, images)
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if m := SESSION_WORDS.search(line):
                found.append(f"{path}:{n}: {m.group(0)!r}")
    assert not bad_names, f"result names tagged by a session: {bad_names}"
    assert not found, f"{len(found)} session words:\n" + "\n".join(found)
