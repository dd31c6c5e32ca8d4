"""A stand-in for llama-cpp-python (not in the test extra), importable where the tests put ``tests/fakes`` on
``sys.path``: ``bench e2e``'s llama.cpp engine runs in a process started afresh, which imports this instead of the
real package. ``FAKE_LLAMA_CPP`` says how it behaves (the environment reaches the engine's process):

- ``greedy`` (the default): a model whose greedy next token is the last token + 1, with the methods the baseline
  calls (reset, eval, sample); what it is made with and handed goes, as JSON lines, to ``FAKE_LLAMA_CPP_LOG``;
  ``FAKE_LLAMA_CPP_TOKENS`` (``a,b,c``) makes it sample those tokens in turn instead, the first from the prefill;
- ``illegal``: loading dies of an illegal instruction, as a build for another CPU does;
- ``broken``: loading raises, as it does on a file that is not a GGUF.
"""

from __future__ import annotations

import json
import os
import signal
import sys


class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, n_batch, flash_attn, verbose):
        behaviour = os.environ.get("FAKE_LLAMA_CPP", "greedy")
        if behaviour == "illegal":
            os.kill(os.getpid(), signal.SIGILL)
        if behaviour == "broken":
            raise ValueError("not a GGUF file")
        made = dict(path=model_path, n_ctx=n_ctx, threads=n_threads, flash_attn=flash_attn, pid=os.getpid())
        self._note(made=made, torch="torch" in sys.modules)  # torch (and its OpenMP runtime) in the engine's process
        self.tokens: list[int] = []

    @staticmethod
    def _note(**entry):
        with open(os.environ["FAKE_LLAMA_CPP_LOG"], "a") as out:
            out.write(json.dumps(entry) + "\n")

    def reset(self):
        self.tokens = []

    def eval(self, tokens):
        if len(tokens) > 1:
            self._note(prompt=list(tokens))
            self.prompt_length = len(tokens)
        self.tokens += list(tokens)

    def sample(self, temp):
        assert temp == 0.0  # greedy
        scripted = os.environ.get("FAKE_LLAMA_CPP_TOKENS")  # "a,b,c": the tokens it samples in turn, from the prefill
        if scripted:
            told = [int(t) for t in scripted.split(",")]
            return told[min(len(self.tokens) - self.prompt_length, len(told) - 1)]
        return (self.tokens[-1] + 1) % 96
