"""``python -m sparsedecode ARGS`` in a process of its own per command, without importing torch each time.

A fresh interpreter spends seconds importing torch and transformers before a command does anything (about 10 s of a
13 s ``run`` on a tiny model here). :class:`ForkedCommands` starts one helper interpreter that imports them (and
never sparsedecode), then forks it once per command: the child takes the command's environment, working directory
and arguments, points its stdin at /dev/null and its stdout and stderr at files, runs the package's ``__main__`` as
``-m`` would, and exits as an interpreter does (``SystemExit``'s code; a traceback on stderr and 1 for an uncaught
exception; ``atexit`` handlers run). So every command starts with sparsedecode unimported and its module state
fresh, as a separate process, and what it writes to either stream (rich, warnings, C libraries) is captured as
``subprocess.run(..., capture_output=True)`` captures it.

Torch reads a few settings (``OMP_NUM_THREADS``) when it is imported: the helper is started with the environment
the commands get, so they see what a fresh interpreter would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_HELPER = r"""
import json, os, runpy, sys, traceback
import torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
import transformers.models.llama.modeling_llama, transformers.models.qwen2.modeling_qwen2
assert not [name for name in sys.modules if name.split(".")[0] == "sparsedecode"], "the helper imported sparsedecode"
replies = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing the helper prints mixes with its replies
print("ready", file=replies, flush=True)
for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(request["stdout"], os.O_WRONLY), 1)
        os.dup2(os.open(request["stderr"], os.O_WRONLY), 2)
        replies.close()
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = ["-m", *request["args"]]
        try:
            runpy.run_module("sparsedecode", run_name="__main__", alter_sys=True)
        except SystemExit:
            raise  # the interpreter exits with its code, as after `python -m`
        except BaseException:
            traceback.print_exc()
            raise SystemExit(1)
        raise SystemExit(0)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), file=replies, flush=True)
"""


class ForkedCommands:
    """Runs ``python -m sparsedecode ARGS`` commands, each in a process forked from one helper (module docstring)."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.helper = subprocess.Popen(
            [sys.executable, "-c", _HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env
        )
        ready = self.helper.stdout.readline()
        assert ready == "ready\n", f"the helper did not start: {ready!r}"

    def run(self, *args: str) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as scratch:
            out, err = Path(scratch) / "stdout", Path(scratch) / "stderr"
            out.touch()
            err.touch()
            request = {"args": list(args), "env": self.env, "cwd": os.getcwd(), "stdout": str(out), "stderr": str(err)}
            self.helper.stdin.write(json.dumps(request) + "\n")
            self.helper.stdin.flush()
            reply = self.helper.stdout.readline()
            assert reply, "the helper died"
            return subprocess.CompletedProcess(
                [sys.executable, "-m", *args], int(json.loads(reply)), out.read_text(), err.read_text()
            )

    def close(self) -> None:
        self.helper.stdin.close()
        self.helper.wait(timeout=60)
