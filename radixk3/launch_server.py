"""`python -m radixk3.launch_server [ServerArgs flags]`: the HTTP server, as SGLang's `sglang.launch_server`.

A public entry point, and so one of the documented exceptions to "radixk3 imports nothing of runtime"
(`radixk3.cli` starts it; tests/test_imports.py lists the entry points)."""

from __future__ import annotations

import sys

from radixk3.cli import main

if __name__ == "__main__":  # the engine spawns its processes, which re-import this module
    raise SystemExit(main(["serve", *sys.argv[1:]]))
