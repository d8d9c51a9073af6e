"""Output paths the commands write: refused at the start with a message naming the flag, never a
traceback after minutes of work; atomic writes leave nothing behind when they fail."""

from __future__ import annotations

import os
import stat
import time

import pytest

from specserve.cli import main
from specserve.errors import ConfigError
from specserve.files import output_dir, output_file, write_atomic


def test_output_file_takes_a_new_file_in_new_folders_and_creates_nothing(tmp_path):
    target = tmp_path / "a" / "b" / "out.json"
    assert output_file(target, "--out") == target
    assert list(tmp_path.iterdir()) == []  # checked by a probe in the nearest existing folder, then removed
    assert output_dir(tmp_path / "work", "--work-dir") == tmp_path / "work" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: d, "is a folder"),
    (lambda d: d / "f" / "out.png" if (d / "f").write_text("x") else None, "is a file, not a folder"),
    (lambda d: "/proc/no-such-folder/out.png", "cannot write in /proc"),
    (lambda d: d / "plot.txt", "must end in one of .pdf, .png"),
    (lambda d: "", "is empty"),
])
def test_output_file_refuses_what_cannot_be_written(tmp_path, make, message):
    with pytest.raises(ConfigError, match=message) as exc:
        output_file(make(tmp_path), "--out", suffixes=(".png", ".pdf"))
    assert str(exc.value).startswith("--out")


def test_write_atomic_leaves_nothing_when_the_write_fails_and_keeps_the_umask(tmp_path):
    target = tmp_path / "out.txt"

    def broken(f):  # noqa: ANN001, ANN202
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_atomic(target, broken)
    assert list(tmp_path.iterdir()) == []
    write_atomic(target, lambda f: f.write(b"whole"))
    mask = os.umask(0o022)
    os.umask(mask)
    assert target.read_bytes() == b"whole" and stat.S_IMODE(target.stat().st_mode) == 0o666 & ~mask  # (mkstemp's: 0600)


@pytest.mark.parametrize(("argv", "message"), [
    (["profile", "--model", "smollm2-135m-instruct", "--out", "/proc/no-such/p.json"], "--out /proc/no-such"),
    (["profile", "--model", "smollm2-135m-instruct", "--out", "{tmp}/p.json", "--batches", "0"], "--batches must be"),
    (["profile", "--model", "smollm2-135m-instruct", "--out", "{tmp}/p.json", "--repeats", "0"], "--repeats must be"),
    (["build-corpus", "--model", "smollm2-135m-instruct", "--out", "{tmp}"], "is a folder"),
    (["train-draft", "--model", "smollm2-135m-instruct", "--out", "{tmp}"], "is a folder"),
    (["train-draft", "--model", "smollm2-135m-instruct", "--work-dir", "/proc/no-such/w"], "--work-dir /proc/no-such"),
])
def test_commands_refuse_an_output_they_cannot_write_before_any_work(tmp_path, capsys, argv, message):
    t0 = time.perf_counter()
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert time.perf_counter() - t0 < 5  # before the model loads
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--max-waiting=-1", "--drain-timeout=-5", "--drain-timeout=nan"])
def test_serve_refuses_negative_limits(capsys, flag):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", "smollm2-135m-instruct", flag])
    assert exc.value.code == 2 and flag.split("=")[0] in capsys.readouterr().err
