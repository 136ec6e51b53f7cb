"""The heartbeat a worker writes for ``fdp launch``: a step writes counters, no system call."""

from __future__ import annotations

import threading

import pytest

from fdp.runtime import _heartbeat


@pytest.fixture
def watched(tmp_path, monkeypatch):
    """This process watched, as under ``fdp launch``: the record's path."""
    path = tmp_path / "rank_0.heartbeat"
    monkeypatch.setenv(_heartbeat.HEARTBEAT_VAR, str(path))
    for key in list(_heartbeat._state):
        monkeypatch.setitem(_heartbeat._state, key, _heartbeat._state[key])
    _heartbeat._state.update(map=None, steps=(0, 0), changes=0, flag="-", waiting="", busy=0)
    yield path
    mapped = _heartbeat._state["map"]
    _heartbeat._state["map"] = False  # nothing writes to it once it is closed
    if mapped:
        with _heartbeat._write_lock:
            mapped.close()


def test_a_finished_step_is_in_the_record_at_once_without_a_system_call(watched, monkeypatch):
    import os

    _heartbeat.step_entered()  # maps the file (the one system call, once per process)
    _heartbeat.step_done()

    def refused(*args):
        raise AssertionError("a step made a system call to write its heartbeat")

    for name in ("pwrite", "write"):
        monkeypatch.setattr(os, name, refused)
    for _ in range(1000):
        _heartbeat.step_entered()
        _heartbeat.step_done()
    beat = _heartbeat.read(str(watched))  # no wait: a worker stopped now is named with it
    assert (beat.entered, beat.finished, beat.inside) == (1001, 1001, False)


def test_a_step_left_inside_shows_as_inside_at_once(watched):
    _heartbeat.step_entered()
    _heartbeat.step_done()
    _heartbeat.step_entered()  # and stays there (e.g. waits on its peers' collective)
    beat = _heartbeat.read(str(watched))  # no wait: no thread writes it later
    assert (beat.entered, beat.finished, beat.inside) == (2, 1, True)


def test_steps_write_their_counters_and_leave_the_rest_of_the_record(watched):
    with _heartbeat.busy(), _heartbeat.waiting("store key 'host/1'"):
        writes = _heartbeat.read(str(watched)).writes
        _heartbeat.step_entered()
        _heartbeat.step_done()
        beat = _heartbeat.read(str(watched))
        assert (beat.finished, beat.busy, beat.waiting) == (1, True, "store key 'host/1'")
        assert beat.writes == writes + 2  # every change shows
    with _heartbeat.compiling():
        _heartbeat.step_entered()  # the first step after compiling clears the flag
        assert not _heartbeat.read(str(watched)).compiling


def test_waits_and_flags_are_written_at_once(watched):
    _heartbeat.step_entered()
    _heartbeat.step_done()
    with _heartbeat.waiting("store key 'host/1'"):
        beat = _heartbeat.read(str(watched))  # no wait for the writer thread
        assert beat.waiting == "store key 'host/1'" and beat.finished == 1
    with _heartbeat.compiling():
        assert _heartbeat.read(str(watched)).compiling
    _heartbeat.exiting()
    assert _heartbeat.read(str(watched)).exiting


def test_a_longer_record_leaves_nothing_behind(watched):
    with _heartbeat.waiting("a host collective with a long name " * 2):
        pass
    beat = _heartbeat.read(str(watched))
    assert beat.waiting == "" and watched.stat().st_size == 128


def test_nothing_is_written_outside_the_launcher(tmp_path, monkeypatch):
    monkeypatch.delenv(_heartbeat.HEARTBEAT_VAR, raising=False)
    for key in list(_heartbeat._state):
        monkeypatch.setitem(_heartbeat._state, key, _heartbeat._state[key])
    _heartbeat._state.update(map=None)
    _heartbeat.step_entered()
    _heartbeat.step_done()
    with _heartbeat.busy():
        pass
    assert _heartbeat._state["map"] is False
    assert not list(tmp_path.iterdir())
    assert not any(t.name == "fdp-heartbeat" for t in threading.enumerate())
