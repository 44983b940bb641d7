"""`streambatch serve` whose engine step raises after N steps: `python fault_server.py N
<serve flags>`. The reliability test's engine fault, reachable from tests only (the server
has no flag or setting for it)."""

from __future__ import annotations

import sys
from typing import Any

from pyserver import cli
from pyserver.engine.adapter.engine import Engine


def main() -> int:
    steps, count = int(sys.argv[1]), 0
    real_step = Engine.step

    def failing_step(self: Engine) -> Any:
        nonlocal count
        count += 1
        if count > steps:
            raise RuntimeError(f"injected fault after {steps} engine steps (test)")
        return real_step(self)

    Engine.step = failing_step  # type: ignore[method-assign]
    return cli.main(["serve", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
