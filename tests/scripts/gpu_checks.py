"""What the GPU test scripts share (test_multi_gpu.py, test_expert_parallel.py,
test_pytorch_crosscheck.py): the skip CTest counts (exit 77), the GPU count, a command run with the
tail of its output shown, and a named check that records its failure."""

import json
import subprocess
import sys


def skip(why):
    """Ends the test as skipped (CTest's SKIP_RETURN_CODE 77), saying why."""
    print(f"SKIPPED: {why}")
    sys.exit(77)


def gpu_count():
    """GPUs nvidia-smi lists (0 without the tool)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True).stdout
    except OSError:
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def run(cmd, timeout=None, tail=12):
    """Runs `cmd` with stdout and stderr together; prints the command and the last `tail` lines.
    Returns (exit code, output); 124 when `timeout` seconds passed."""
    print("+ " + " ".join(cmd), flush=True)
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print("\n".join(out.splitlines()[-tail:]), flush=True)
        print(f"timed out after {timeout} s", flush=True)
        return 124, out
    print("\n".join(p.stdout.splitlines()[-tail:]), flush=True)
    return p.returncode, p.stdout


def check(cond, message, failures):
    """Prints `ok` or `FAIL` with the message; a failure is appended to `failures`."""
    print(("ok   " if cond else "FAIL ") + message, flush=True)
    if not cond:
        failures.append(message)


def load(path):
    with open(path) as f:
        return json.load(f)
