"""The grammar compiler process's main (structured_output/compiler_process.py starts it as
`python -m pagedllm.structured_output.compiler_child FD MAX_THREADS`): it receives the
tokenizer's xgrammar vocabulary, then compiles one job at a time and sends each compiled
grammar back serialized, until its link closes or its parent ends."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


def _child_main(fd: int, max_threads: int) -> None:
    """The compiler process: one job at a time until its link closes (or its parent ends)."""
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    conn = Connection(fd)
    # lazy: xgrammar is optional (pagedllm[structured]) and slow to import (2 s)
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(conn.recv_bytes().decode())
    compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
    compile_by_kind: dict[str, Callable[[str, bool], Any]] = {
        "json": lambda text, ws: compiler.compile_json_schema(text, any_whitespace=ws),
        "regex": lambda text, ws: compiler.compile_regex(text),
        "grammar": lambda text, ws: compiler.compile_grammar(text),
        "structural_tag": lambda text, ws: compiler.compile_structural_tag(text),
    }
    conn.send(("ready", os.getpid()))
    while True:
        try:
            kind, text, any_whitespace = conn.recv()
        except (EOFError, OSError):
            return
        try:
            compiled = compile_by_kind[kind](text, any_whitespace)
            conn.send(("ok", compiled.serialize_json()))
        except Exception as exc:  # the constraint's own error: the client's 400
            conn.send(("error", str(exc) or type(exc).__name__))


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), int(sys.argv[2]))
