"""One model from two threads: decodes never end the process, and a decode stepped from another thread is a
named error that leaves it usable (MLX keeps its streams per thread)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

import moebench
from moebench.errors import DecodeError
from moebench.inspect.record import Stepper

PROMPT = [9, 120, 33, 7]

TWO_THREADS = """
import threading, moebench
from moebench.inspect.record import Stepper
m, _ = moebench.load()
expected = moebench.generate(m, [9, 120, 33, 7], 12).token_ids
for _ in range(8):
    out = {}
    def run(i):
        if i % 2:
            out[i] = moebench.generate(m, [9, 120, 33, 7], 12).token_ids
        else:
            out[i] = Stepper(m, None, [9, 120, 33, 7], record=True).run(12).token_ids
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(v == expected for v in out.values()) and len(out) == 4, out
print("ok")
"""


def test_decodes_of_one_model_from_several_threads_end_cleanly():
    done = subprocess.run([sys.executable, "-c", TWO_THREADS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.fixture(scope="module")
def model(quantized_checkpoint):
    return moebench.load(quantized_checkpoint)[0]


def test_a_stepper_used_from_another_thread_is_named_and_stays_usable(model):
    stepper = Stepper(model, None, PROMPT, record=True)
    stepper.prefill()
    errors = []

    def other():
        for call in (stepper.step, lambda: stepper.run(2), stepper.close):
            try:
                call()
            except DecodeError as e:
                errors.append(str(e))

    thread = threading.Thread(target=other, name="worker")
    thread.start()
    thread.join()
    assert len(errors) == 3 and all("'worker'" in e and "per thread" in e for e in errors)
    expected = Stepper(model, None, PROMPT, record=True).run(5).token_ids
    assert stepper.run(4).token_ids == expected
