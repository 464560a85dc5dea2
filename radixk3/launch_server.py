"""`python -m radixk3.launch_server [ServerArgs flags]`: the HTTP server, as SGLang's `sglang.launch_server`."""

from __future__ import annotations

import sys

from radixk3.cli import main

if __name__ == "__main__":  # the engine spawns its processes, which re-import this module
    raise SystemExit(main(["serve", *sys.argv[1:]]))
