"""fdp launch's output: one prefixed line at a time per rank, progress bars, quiet
transport logs, log files (--log-dir, --tee), --console-ranks and the final table.

The real-process tests run tests/workers/chatty.py (no JAX: they start in well under
a second); the `marker` fixture checks that no process they started is left alive.
"""

import io
import re

import pytest
from _procs import launch

from fdp.launch._cli import build_parser
from fdp.launch._config import from_namespace
from fdp.launch._output import CONSOLE, GLOO_LINE, Console, Splitter, split_noise


def chatty(marker, *launch_args, **env):
    out = launch(
        ["--nproc-per-node", "2", *launch_args], "chatty.py", [], marker, timeout=60, **env
    )
    assert out.returncode == 0, out.output
    return out


def test_lines_are_whole_prefixed_transport_logs_left_out_and_a_table_at_the_end(marker):
    out = chatty(marker)
    for rank in (0, 1):
        assert f"[rank {rank}] pieces of rank {rank}\n" in out.stdout  # written in 3 pieces
        assert f"[rank {rank}] err from rank {rank}\n" in out.stderr
        # On a pipe, a progress bar shows only its final state, gloo's line cut out of it.
        assert f"[rank {rank}] bar 3/3 of rank {rank}\n" in out.stdout
        assert f"bar 2/3 of rank {rank}" not in out.stdout
        # Written between gloo's text and its newline: kept, and gloo's newline left out.
        assert f"[rank {rank}] glued to gloo's line by rank {rank}\n" in out.stdout
        assert f"[rank {rank}] \n" not in out.stdout
        # Printed between two of gloo's C++ pieces: C's stdout is line-buffered.
        assert f"[rank {rank}] between gloo's pieces by rank {rank}\n" in out.stdout
        # gloo's whole line between a print's text and its newline: the line joins up.
        assert f"[rank {rank}] printed around gloo's line by rank {rank}\n" in out.stdout
    assert "Gloo" not in out.output and "peer ranks" not in out.output  # nor half of it
    assert all(line.startswith("[rank ") for line in out.stdout.splitlines())
    # Every run ends with a table of the workers.
    summary = out.stderr.split("fdp launch: all 2 worker(s) succeeded (attempt 1 of 1, run id ")[1]
    rows = [line.split() for line in summary.splitlines()[1:]]
    assert rows[0] == ["rank", "local", "rank", "pid", "result", "ended", "with", "after"]
    assert [(r[0], r[3:6]) for r in rows[1:]] == [(str(k), ["ok", "exit", "code"]) for k in (0, 1)]


def test_fdp_debug_shows_transport_logs_on_lines_of_their_own(marker):
    out = chatty(marker, FDP_DEBUG="INFO")
    assert "[rank 1] [Gloo] Rank 1 is connected to 1 peer ranks." in out.stdout
    # Written while rank 1's bar was open, gloo's line still gets a line of its own.
    assert "[rank 1] [Gloo] Rank 5 is connected to 7 peer ranks." in out.stdout
    # Cut in two by the bar, each half on a line of its own.
    assert "[rank 1] [Gloo] Rank 3 is connected to \n" in out.stdout
    assert "[rank 1] 3 peer ranks. Expected number of connected peer ranks is : 3\n" in out.stdout
    assert "[rank 1] bar 3/3 of rank 1\n" in out.stdout
    whole = "[Gloo] Rank 7 is connected to 1 peer ranks. "
    whole += "Expected number of connected peer ranks is : 1"
    assert f"[rank 1] {whole}\n[rank 1] glued to gloo's line by rank 1\n" in out.stdout
    # gloo's C++ pieces reach the pipe as one line, after the line printed between them.
    whole = "[Gloo] Rank 9 is connected to 1 peer ranks. "
    whole += "Expected number of connected peer ranks is : 1"
    assert f"[rank 1] between gloo's pieces by rank 1\n[rank 1] {whole}\n" in out.stdout
    # Between a print's text and its newline: gloo's line first, then the print's, whole.
    whole = whole.replace("Rank 9", "Rank 11")
    assert f"[rank 1] {whole}\n[rank 1] printed around gloo's line by rank 1\n" in out.stdout


def test_log_files_count_attempts_from_1_and_tee_shows_the_console_too(tmp_path, marker):
    out = chatty(marker, "--log-dir", tmp_path, "--tee")
    assert f"logs in {tmp_path}/attempt_1" in out.stderr
    for rank in (0, 1):
        text = (tmp_path / "attempt_1" / f"rank_{rank}.log").read_text()
        # The file holds what the worker wrote, transport logs and all.
        assert f"[Gloo] Rank {rank} is connected" in text and f"err from rank {rank}" in text
        assert f"[rank {rank}] pieces of rank {rank}" in out.stdout
    quiet = chatty(marker, "--log-dir", tmp_path / "q")
    assert "[rank" not in quiet.stdout and (tmp_path / "q" / "attempt_1" / "rank_1.log").exists()


def test_console_ranks_choose_whose_output_is_shown(marker):
    out = chatty(marker, "--console-ranks", "1")
    assert "[rank 1] pieces of rank 1" in out.stdout
    assert "[rank 0]" not in out.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--tee"],
            "--tee shows the output on the console as well as in the log files: it "
            "needs --log-dir DIR",
        ),
        (["--console-ranks", "2"], "--console-ranks must name ranks below the world size 2"),
        (["--console-ranks", "first"], "--console-ranks must be 'all' or ranks >= 0"),
    ],
)
def test_bad_output_options_are_named(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        from_namespace(build_parser().parse_args(["--nproc-per-node", "2", *args, "t.py"]))


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_redraws_one_progress_line_and_prints_other_lines_above_it():
    term, console = Terminal(), Console()
    console.progress(term, 0, "[rank 0] bar 1/3")
    console.line(term, 1, "[rank 1] hello")  # erases the bar, prints, draws it again
    console.progress(term, 0, "[rank 0] bar 2/3")
    console.line(term, 0, "[rank 0] bar 3/3")  # the bar's own final line ends it
    console.end()
    assert term.getvalue() == (
        "\r\x1b[K[rank 0] bar 1/3\r\x1b[K[rank 1] hello\n\r\x1b[K[rank 0] bar 1/3"
        "\r\x1b[K\r\x1b[K[rank 0] bar 2/3\r\x1b[K[rank 0] bar 3/3\n"
    )
    pipe = io.StringIO()
    CONSOLE.progress(pipe, 0, "bar")  # not a terminal: dropped
    assert pipe.getvalue() == ""


def test_records_end_at_newlines_and_carriage_returns():
    s = Splitter()
    assert s.feed(b"a\r\nb\r") == [("a", True)]  # "\r" at the end may start "\r\n"
    assert s.feed(b"c\n") == [("b", False), ("c", True)]
    assert s.feed(b"x" * 70000) == [("x" * 70000, True)]  # bounded
    gloo = b"[Gloo] Rank 0 is connected to 1 peer ranks. "
    gloo += b"Expected number of connected peer ranks is : 1\n"
    s = Splitter(cut=GLOO_LINE)
    # Across reads, inside a print and inside a progress bar, in the order written.
    assert s.feed(b"a\nloss 0.25" + gloo[:20]) == [("a", True)]
    assert s.feed(gloo[20:] + b"\n\rbar 1" + gloo + b"\rbar 2\n") == [
        (
            "[Gloo] Rank 0 is connected to 1 peer ranks. "
            "Expected number of connected peer ranks is : 1",
            True,
        ),
        ("loss 0.25", True),
        (
            "[Gloo] Rank 0 is connected to 1 peer ranks. "
            "Expected number of connected peer ranks is : 1",
            True,
        ),
        ("bar 1", False),
        ("bar 2", True),
    ]
    assert split_noise(
        "W1123 07:49:17.936475   27353 preemption_notifier.cc:90] SIGTERM caught at"
    )[1]


def test_a_line_left_in_c_stdout_is_printed_when_the_worker_fails(marker):
    """C's stdout is line-buffered under fdp launch; the bootstrap's os._exit flushes it."""
    out = launch(["--nproc-per-node", "1"], "c_line.py", [], marker, timeout=60)
    assert out.returncode == 1, out.output
    assert "[rank 0] half a C line\n" in out.stdout
