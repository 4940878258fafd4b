"""Nothing lost under concurrency or faults: pool merges from processes finishing together, writers killed mid-write,
a full disk (issue 32, part 3)."""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clova_train.core.atomic import remove_stale_temporaries, write_atomic, write_text_atomic
from clova_train.core.errors import StorageError
from clova_train.core.manifest import staged_directory
from clova_train.core.pool import PoolSpec, PromptPool, merge_into_file

SPEC = PoolSpec("clip", "test-model", (2, 3), 4)
WRITERS = 8


def small_pool(writer: int) -> PromptPool:
    pool = PromptPool(SPEC)
    generator = torch.Generator().manual_seed(writer)
    pool.add(f"concept-{writer % 2}", torch.randn(3, 4, generator=generator), torch.randn(3, 2, 3, generator=generator),
             [f"w{writer}-{k}" for k in range(3)])
    return pool


def _merge_at_once(path: str, writer: int, barrier: multiprocessing.synchronize.Barrier) -> None:
    pool = small_pool(writer)
    barrier.wait()  # every process reads, merges and writes at the same moment
    merge_into_file(path, pool)


def test_processes_merging_into_one_pool_at_once_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "shared" / "pool.safetensors"
    small_pool(99).save(path)  # an existing pool that every merge must keep too
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(WRITERS)
    processes = [context.Process(target=_merge_at_once, args=(str(path), w, barrier)) for w in range(WRITERS)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert [p.exitcode for p in processes] == [0] * WRITERS
    merged = PromptPool.load(path, expected=SPEC)
    ids = sorted(i for concept in merged.concepts for i in merged.entry(concept)[2])
    assert ids == sorted(f"w{w}-{k}" for w in [*range(WRITERS), 99] for k in range(3))
    assert sorted(p.name for p in path.parent.iterdir()) == [".pool.safetensors.lock", "pool.safetensors"]


def test_a_merge_keeps_the_prompts_of_both_pools_and_overwrite_replaces(tmp_path: Path) -> None:
    path = tmp_path / "pool.safetensors"
    assert merge_into_file(path, small_pool(0)) == 3
    assert merge_into_file(path, small_pool(2)) == 3  # same concept, other instances
    assert merge_into_file(path, small_pool(2)) == 0  # instances it holds are kept once
    assert len(PromptPool.load(path)) == 6
    assert merge_into_file(path, small_pool(1), overwrite=True) == 3
    assert PromptPool.load(path).concepts == ["concept-1"]


KILLED_WRITER = """
import os, signal, sys
from clova_train.core.atomic import write_atomic

def half_then_die(tmp):
    tmp.write_text("half of the new")
    os.kill(os.getpid(), signal.SIGKILL)

write_atomic(sys.argv[1], half_then_die)
"""


def test_a_killed_writer_leaves_a_temporary_that_the_next_write_removes(tmp_path: Path) -> None:
    target = tmp_path / "summary.json"
    target.write_text("old")
    killed = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)])
    assert killed.wait(timeout=120) == -signal.SIGKILL
    left = [p for p in tmp_path.iterdir() if p != target]
    assert len(left) == 1 and left[0].read_text() == "half of the new" and target.read_text() == "old"
    assert left[0].name.startswith(f".summary.json.{socket.gethostname()}-{killed.pid}.")
    # what stays: a live writer's temporary, another host's (a shared file system), another file's
    live = tmp_path / f".summary.json.{socket.gethostname()}-1.abc.tmp"  # pid 1 is alive
    other_host = tmp_path / f".summary.json.another-host-{dead_pid()}.abc.tmp"
    other_file = tmp_path / f".other.json.{socket.gethostname()}-{dead_pid()}.abc.tmp"
    for path in (live, other_host, other_file):
        path.write_text("x")
    write_text_atomic(target, "new")
    assert target.read_text() == "new"
    assert sorted(tmp_path.iterdir()) == sorted([target, live, other_host, other_file])


def dead_pid() -> int:
    """The pid of a process that has exited."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_an_export_staging_directory_left_by_a_killed_export_is_removed_by_the_next(tmp_path: Path) -> None:
    output = tmp_path / "export"
    stale = tmp_path / f".export.{socket.gethostname()}-{dead_pid()}.x1y2.staging"
    (stale / "adapter").mkdir(parents=True)
    (stale / "adapter" / "weights.bin").write_bytes(b"\0" * 10)
    with staged_directory(output) as staging:
        (staging / "file.txt").write_text("done")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert (output / "file.txt").read_text() == "done"
    assert remove_stale_temporaries(output) == []


def disk_full(*_: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_ends_in_one_error_with_the_old_file_intact(tmp_path: Path) -> None:
    target = tmp_path / "pool.safetensors"
    small_pool(0).save(target)
    before = target.read_bytes()
    with pytest.raises(StorageError, match=rf"no space left on the device to write {target} .*is as it was before"):
        write_atomic(target, disk_full)
    assert target.read_bytes() == before and sorted(tmp_path.iterdir()) == [target]


def test_a_full_disk_during_an_export_keeps_the_previous_export(tmp_path: Path) -> None:
    output = tmp_path / "export"
    output.mkdir()
    (output / "old.txt").write_text("previous export")
    with pytest.raises(StorageError, match=rf"no space left on the device to write {output} "):
        with staged_directory(output) as staging:
            (staging / "part.txt").write_text("half")
            disk_full()
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    assert [p.name for p in output.iterdir()] == ["old.txt"]


def test_the_cli_reports_a_full_disk_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                                 tmp_path: Path) -> None:
    """A write outside the atomic helpers (here: copying the base model into an export) still ends in one line."""
    from clova_train import cli

    def full_copy(source: object, destination: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(destination))

    monkeypatch.setitem(cli.SUBCOMMANDS, "export", lambda args: full_copy("base", tmp_path / "out" / "model.safetensors"))
    assert cli.main(["export", "run", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"clova-train: error: no space left on the device to write {tmp_path / 'out' / 'model.safetensors'}" in err
