"""`python -m engine.native`: build the C++ layer loops now (otherwise the first model load does). Exits 0 when it
cannot build them, saying why: the layers then run from Python."""
from __future__ import annotations

import sys
import time

from engine import native


def main() -> int:
    start = time.perf_counter()
    if native.layers() is None:   # not an error: the models then run their layers from Python
        print(f"not built: {native.reason()}; the models run their layers from Python", file=sys.stderr)
        return 0
    print(f"the C++ layer loops are ready in {native.build_folder()} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
