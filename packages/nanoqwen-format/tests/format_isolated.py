"""Run the reader on untrusted files in a child process, so a hang or a memory blow-up is caught, not suffered.

The child has an address-space limit (RLIMIT_AS) and the parent a deadline per file: a file that makes the
reader loop is killed after `timeout` seconds and reported as a hang; one that makes it allocate past the
limit raises MemoryError in the child, which is reported like any other exception that is not a
NanoqwenFormatError.

Child side (`python format_isolated.py WORKDIR`): reads file paths from stdin, one per line, exercises each
(`exercise`), and answers one JSON line per file: {"ok": true, "accepted": bool, "verify_accepted": bool}
or {"ok": false, "error": "<type>: <message>", "where": "<last frames>"}.

Parent side: `Isolated` keeps one child for many files (the fuzz), `run_one` starts one for one file.
"""

import json
import os
import resource
import selectors
import subprocess
import sys
import traceback
from contextlib import closing
from pathlib import Path

MEMORY_LIMIT = 1 << 30  # the child imports numpy (~115 MB of address space) and maps small files


def exercise(path) -> dict:
    """open_model plain and verify=True; when a file is accepted, every tensor view, every dequantize, and
    the inspect command's text. Only NanoqwenFormatError may escape any of it."""
    from nanoqwen_format import NanoqwenFormatError, open_model
    from nanoqwen_format.cli import describe, summary_lines
    from nanoqwen_format.layout import source_tensors

    result = {}
    for verify in (False, True):
        key = "verify_accepted" if verify else "accepted"
        try:
            m = open_model(path, verify=verify)
        except NanoqwenFormatError as e:
            if not str(e) or "\n" in str(e):
                raise AssertionError(f"error message is not one non-empty line: {str(e)!r}") from None
            result[key] = False
            continue
        result[key] = True
        with m:
            for name in m.tensor_names:
                m.tensor(name).sum(dtype="float64")  # touch every byte of the view
            for s in source_tensors(m.config):
                m.dequantize(s.hf_name)
            summary_lines(describe(m), verify)
    return result


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _child_env() -> dict:
    # One BLAS/OpenMP thread: their per-thread buffers would count against the address-space limit.
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class Isolated:
    """One child process that exercises files on request; a hang or a crash ends it (and is reported).
    close() ends the child: use it as `with closing(Isolated()) as child`."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=_child_env(), preexec_fn=_limit_memory,
                                     text=True, bufsize=1)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)

    def run(self, path, timeout: float) -> dict:
        """The child's answer for one file, or {"ok": false, "error": "hang ..."/"crash ..."}."""
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        if not self._sel.select(timeout):
            self.close()
            return {"ok": False, "error": f"hang: no answer within {timeout} s"}
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            err = self.proc.stderr.read()[-2000:]
            return {"ok": False, "error": f"crash: the child exited with status {code}", "where": err}
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()
        self._sel.close()


def run_one(path, timeout: float = 30.0) -> dict:
    with closing(Isolated()) as child:
        return child.run(path, timeout)


def _child():
    for line in sys.stdin:
        path = Path(line.rstrip("\n"))
        try:
            answer = {"ok": True, **exercise(path)}
        except BaseException as e:  # MemoryError, RecursionError, anything: the parent judges it
            tb = traceback.extract_tb(e.__traceback__)[-3:]
            answer = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}",
                      "where": " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(tb))}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _child()
