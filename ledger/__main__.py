"""`python -m ledger vacuum <database-url>`: remove erased content that still sits at rest (see README.md)."""
from __future__ import annotations

import json
import sys

from .ledger import Ledger


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "vacuum":
        print("usage: python -m ledger vacuum <database-url>   (e.g. sqlite:///var/lethe.db)", file=sys.stderr)
        return 2
    ledger = Ledger(argv[1])
    try:
        ledger.vacuum()
    finally:
        ledger.close()
    print(json.dumps({"vacuumed": ledger._engine.dialect.name}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
