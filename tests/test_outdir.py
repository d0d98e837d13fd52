"""Atomic output directories (lantern.runtime.outdir) with real concurrent and killed processes."""
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

from pathlib import Path

import numpy as np
import pytest

from lantern.runtime.errors import LanternError
from lantern.runtime.outdir import OutputDirectory, check_destination, only_files, write_file

# A run in a child process: stage `tokens.npy` holding its pid, then (per mode) place at once,
# wait for a release file, or die in the middle of the swap.
CHILD = textwrap.dedent(r"""
    import os, signal, sys, time
    from lantern.runtime.errors import LanternError
    from lantern.runtime.outdir import OutputDirectory
    dest, mode = sys.argv[1], sys.argv[2]
    if mode == "race":
        while not os.path.exists(dest + ".go"):
            time.sleep(0.001)
    if mode == "die-mid-swap":
        real = os.rename
        def rename(a, b):
            real(a, b)
            if ".old-" in os.path.basename(b):
                os.kill(os.getpid(), signal.SIGKILL)
        os.rename = rename
    out = OutputDirectory(dest, force=mode == "die-mid-swap")
    try:
        stage = out.open()
    except LanternError as e:
        print("refused", e, flush=True)
        sys.exit(2)
    with open(os.path.join(stage, "tokens.npy"), "w") as f:
        f.write(str(os.getpid()))
    print("staged", flush=True)
    if mode in ("hold", "race"):
        deadline = time.time() + 20
        while not os.path.exists(dest + ".release") and time.time() < deadline:
            time.sleep(0.01)
    out.place()
    print("placed", flush=True)
""")


def child(dest, mode):
    return subprocess.Popen([sys.executable, "-c", CHILD, str(dest), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def hidden(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


def write_run(stage, pid="me", images=1):
    (stage / "tokens.npy").write_text(pid)
    (stage / "stats.json").write_text("{}")
    for i in range(images):
        (stage / f"image_{i:03d}.png").write_bytes(b"png")


# ---------------------------------------------------------------------------------------------
# One run


def test_outputs_appear_together_and_a_reused_directory_holds_only_the_new_run(tmp_path):
    dest = tmp_path / "out"
    with OutputDirectory(dest) as stage:
        write_run(Path(stage), images=3)
        assert not dest.exists()  # nothing at the destination until the run is done
    assert sorted(os.listdir(dest)) == ["image_000.png", "image_001.png", "image_002.png", "stats.json", "tokens.npy"]
    with pytest.raises(LanternError, match="already exists; pass --force"):
        OutputDirectory(dest).open()
    with OutputDirectory(dest, force=True) as stage:
        write_run(Path(stage), pid="second", images=1)
    assert sorted(os.listdir(dest)) == ["image_000.png", "stats.json", "tokens.npy"]
    assert (dest / "tokens.npy").read_text() == "second"
    assert hidden(tmp_path) == []


def test_a_failed_run_leaves_nothing_and_keeps_the_old_outputs(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    write_run(dest, pid="old")
    with pytest.raises(RuntimeError):
        with OutputDirectory(dest, force=True) as stage:
            (Path(stage) / "tokens.npy").write_text("half")
            raise RuntimeError("the run failed")
    assert (dest / "tokens.npy").read_text() == "old" and hidden(tmp_path) == []


def test_an_empty_directory_is_used_without_force(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    with OutputDirectory(dest) as stage:
        write_run(Path(stage))
    assert (dest / "tokens.npy").read_text() == "me"


@pytest.mark.parametrize("case", ["file", "under_file", "symlink", "foreign", "nested"])
def test_what_force_never_replaces(tmp_path, case):
    dest = tmp_path / "out"
    if case == "file":
        dest.write_text("keep")
        message = "is a file"
    elif case == "under_file":
        (tmp_path / "f").write_text("keep")
        dest = tmp_path / "f" / "sub" / "out"
        message = "is a file, not a directory"
    elif case == "symlink":
        (tmp_path / "real").mkdir()
        dest.symlink_to(tmp_path / "real")
        message = "symbolic link"
    elif case == "foreign":
        dest.mkdir()
        write_run(dest)
        (dest / "notes.txt").write_text("keep")
        message = "it holds 'notes.txt'"
    else:
        dest.mkdir()
        (dest / "image_000.png").mkdir()  # a directory with an output's name is not an output
        message = "it holds 'image_000.png'"
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(LanternError, match=message) as e:
        OutputDirectory(dest, force=True).open()
    assert "\n" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, nothing removed


def test_modes_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        with OutputDirectory(tmp_path / "out") as stage:
            write_file(os.path.join(stage, "tokens.npy"), b"x")
            from lantern.runtime.png import write_png
            write_png(os.path.join(stage, "image_000.png"), np.zeros((2, 2, 3), np.uint8))
            with open(os.path.join(stage, "stats.json"), "w") as f:
                f.write("{}")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(tmp_path / "out") == 0o750
    assert {name: mode(tmp_path / "out" / name) for name in os.listdir(tmp_path / "out")} == {
        "tokens.npy": 0o640, "image_000.png": 0o640, "stats.json": 0o640}


# ---------------------------------------------------------------------------------------------
# Something else at the destination while the run ran


def test_a_folder_that_appears_during_the_run_is_not_replaced(tmp_path):
    dest = tmp_path / "out"
    run = OutputDirectory(dest, force=True)
    write_run(Path(run.open()))
    dest.mkdir()
    (dest / "tokens.npy").write_text("a user's")  # even one that looks like outputs
    with pytest.raises(LanternError, match="did not create was put there") as e:
        run.place()
    assert (dest / "tokens.npy").read_text() == "a user's"
    kept = tmp_path / f"out.unplaced-{os.getpid()}"
    assert str(kept) in str(e.value) and (kept / "tokens.npy").read_text() == "me"
    assert hidden(tmp_path) == []


def test_a_directory_swapped_in_during_the_run_is_not_replaced(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    write_run(dest, pid="old")
    run = OutputDirectory(dest, force=True)
    write_run(Path(run.open()))
    dest.rename(tmp_path / "moved")
    dest.mkdir()
    write_run(dest, pid="someone else's")
    with pytest.raises(LanternError, match="replaced by something else"):
        run.place()
    assert (dest / "tokens.npy").read_text() == "someone else's"


def test_files_added_to_an_empty_directory_during_the_run_are_kept(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    run = OutputDirectory(dest)
    write_run(Path(run.open()))
    (dest / "tokens.npy").write_text("a user's")
    with pytest.raises(LanternError, match="put there while this run ran"):
        run.place()
    assert (dest / "tokens.npy").read_text() == "a user's"


# ---------------------------------------------------------------------------------------------
# Other processes


def test_a_second_run_fails_at_once_naming_the_first(tmp_path):
    dest = tmp_path / "out"
    first = child(dest, "hold")
    assert first.stdout.readline().strip() == "staged"
    with pytest.raises(LanternError, match=f"another run \\(pid {first.pid}\\) is writing it"):
        OutputDirectory(dest, force=True).open()
    (tmp_path / "out.release").touch()
    assert first.wait(20) == 0
    assert (dest / "tokens.npy").read_text() == str(first.pid)
    assert hidden(tmp_path) == []


def test_racing_runs_one_wins_and_nothing_mixes(tmp_path):
    dest = tmp_path / "out"
    runs = [child(dest, "race") for _ in range(4)]
    time.sleep(0.3)  # let them all reach the start line
    (tmp_path / "out.go").touch()
    time.sleep(0.3)
    (tmp_path / "out.release").touch()
    results = [(r.wait(20), r.stdout.read(), r.pid) for r in runs]
    winners = [pid for rc, text, pid in results if rc == 0]
    assert len(winners) == 1, results
    for rc, text, pid in results:
        if rc:
            lines = text.strip().splitlines()
            assert rc == 2 and len(lines) == 1 and lines[0].startswith("refused"), text
            assert "is writing it now" in lines[0] or "already exists" in lines[0]
    assert os.listdir(dest) == ["tokens.npy"] and (dest / "tokens.npy").read_text() == str(winners[0])
    assert hidden(tmp_path) == []


def test_a_killed_runs_leftovers_are_removed_by_the_next_run(tmp_path, capsys):
    dest = tmp_path / "out"
    victim = child(dest, "hold")
    assert victim.stdout.readline().strip() == "staged"
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    left = hidden(tmp_path)
    assert ".out.lock" in left and any(n.startswith(".out.tmp-") for n in left)
    with OutputDirectory(dest) as stage:
        write_run(Path(stage))
    assert hidden(tmp_path) == [] and (dest / "tokens.npy").read_text() == "me"
    assert "left by an interrupted run" in capsys.readouterr().err


def test_a_run_killed_mid_swap_gets_the_old_directory_restored(tmp_path, capsys):
    dest = tmp_path / "out"
    dest.mkdir()
    write_run(dest, pid="old")
    victim = child(dest, "die-mid-swap")
    assert victim.wait(20) == -signal.SIGKILL
    assert not dest.exists() and any(n.startswith(".out.old-") for n in hidden(tmp_path))
    with pytest.raises(LanternError, match="already exists"):  # restored, so it needs --force again
        OutputDirectory(dest).open()
    assert "restored" in capsys.readouterr().err
    assert (dest / "tokens.npy").read_text() == "old" and hidden(tmp_path) == []


def test_check_destination_writes_nothing(tmp_path):
    check_destination(tmp_path / "a" / "b" / "c")
    assert os.listdir(tmp_path) == []
    policy = only_files(("*.txt",), "the test")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("")
    check_destination(tmp_path / "d", force=True, replaceable=policy)
    with pytest.raises(LanternError, match="pass --force"):
        check_destination(tmp_path / "d", replaceable=policy)
