"""fdp.reached_preemption alone (several processes: tests/launch/test_preemption_and_resize.py)."""

from _procs import run

SCRIPT = """
import os, signal
import fdp
assert fdp.reached_preemption(0) is False  # installs the SIGTERM handler
os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal
print([fdp.reached_preemption(s) for s in (1, 2)])
"""


def test_sigterm_is_recorded_and_reported_at_the_next_step(marker):
    out = run(["-c", SCRIPT], marker, timeout=120)
    assert out.returncode == 0, out.output
    assert out.stdout.strip() == "[True, True]"


def test_it_must_first_be_called_from_the_main_thread(marker):
    script = (
        "import threading, fdp\n"
        "errors = []\n"
        "def f():\n"
        "    try: fdp.reached_preemption(0)\n"
        "    except RuntimeError as e: errors.append(str(e))\n"
        "t = threading.Thread(target=f); t.start(); t.join()\n"
        "print(errors[0])\n"
    )
    out = run(["-c", script], marker, timeout=120)
    assert "must first be called from the main thread" in out.stdout, out.output
