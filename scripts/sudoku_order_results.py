"""Tables from the JSON lines of scripts/sudoku_order_eval.sh: per acceptance order and bucket, solved
with 95% Wilson intervals, on validation (single shot) and on the test sets (single shot, 8 x 8 search).

    python scripts/sudoku_order_results.py OUT
"""

import json
import re
import sys
from pathlib import Path

from sudoku_search_results import cell  # one table cell format for both result scripts

BUCKETS = ("easy", "medium", "hard", "minimal")
GIVENS = {"easy": "40-45", "medium": "30-39", "hard": "24-29", "minimal": "21-23"}
ORDERS = ("entropy", "margin", "confidence")
NAME = re.compile(r"(?P<split>val|test)-(?P<order>\w+)-(?P<budget>\d+x\d+)-(?P<bucket>\w+)\.json$")


def main():
    runs = {}
    for f in sorted(Path(sys.argv[1]).glob("*.json")):
        m = NAME.match(f.name)
        if m and f.read_text().strip():
            runs[(m["split"], m["order"], m["budget"], m["bucket"])] = json.loads(f.read_text())
    for split, budget, title in (("val", "1x1", "validation, single shot"), ("test", "1x1", "test, single shot"),
                                 ("test", "8x8", "test, 8 x 8 search")):
        buckets = [b for b in BUCKETS if any((split, o, budget, b) in runs for o in ORDERS)]
        if not buckets:
            continue
        print(f"| order ({title}) | " + " | ".join(f"{b} ({GIVENS[b]})" for b in buckets) + " | forwards per puzzle |")
        print("|---|" + "---|" * (len(buckets) + 1))
        for order in ORDERS:
            rows = [runs.get((split, order, budget, b)) for b in buckets]
            if any(rows):
                forwards = " / ".join(f"{r['forwards_per_puzzle']:.1f}" if r else "-" for r in rows)
                print(f"| {order} | " + " | ".join(cell(r) for r in rows) + f" | {forwards} |")
        print()


if __name__ == "__main__":
    main()
