"""Gather the demo model's training text from what this machine already has (no download).

Four kinds of text, each a JSONL file of {"text": ...} documents under OUT/:
- python:  the Python standard library's own source (*.py; tests, idlelib and lib2to3 left out).
           License: PSF License 2.0.
- docs:    the Python Language Reference topics that ship with Python (pydoc_data.topics).
           License: PSF License 2.0.
- fortune: Debian's `fortunes` and `fortunes-min` packages (/usr/share/games/fortunes): quotations,
           jokes and aphorisms, one document per fortune. License: BSD (see /usr/share/doc/fortunes/copyright).
           Install with `apt-get install fortunes fortunes-min`.
- json:    JSON records made up by make_json_records below from its own word lists (no outside text).

    python scripts/demo/collect_corpus.py --out build/demo_corpus
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
from pathlib import Path

FORTUNE_DIR = Path("/usr/share/games/fortunes")
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__", "turtledemo"}
# offensive fortunes live in off/; text with very long lines (ascii art) teaches little
SKIP_FORTUNE_FILES = {"ascii-art", "art"}


def python_sources(max_bytes: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if not 200 <= len(text) <= 200_000:
            continue
        docs.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return docs


def python_docs() -> list[str]:
    from pydoc_data.topics import topics
    return [text.strip() for _, text in sorted(topics.items()) if len(text.strip()) > 100]


def fortunes() -> list[str]:
    if not FORTUNE_DIR.is_dir():
        raise SystemExit(f"{FORTUNE_DIR} is missing: install Debian's fortunes and fortunes-min packages")
    docs = []
    for path in sorted(FORTUNE_DIR.iterdir()):
        if path.suffix or path.is_dir() or path.name in SKIP_FORTUNE_FILES:
            continue   # .dat indexes, .u8 links
        text = path.read_text(encoding="utf-8", errors="replace")
        for item in text.split("\n%\n"):
            item = item.strip("%\n ")
            if 20 <= len(item) <= 1200 and max(len(line) for line in item.splitlines()) < 100:
                docs.append(item)
    return docs


FIRST = ["Ada", "Alan", "Grace", "Linus", "Barbara", "Ken", "Margaret", "Dennis", "Frances", "Edsger", "Radia",
         "Guido", "Hedy", "Tim", "Katherine", "John", "Sophie", "Niklaus", "Anita", "Donald", "Leslie", "Mary"]
LAST = ["Lovelace", "Turing", "Hopper", "Torvalds", "Liskov", "Thompson", "Hamilton", "Ritchie", "Allen",
        "Dijkstra", "Perlman", "Rossum", "Lamarr", "Peters", "Johnson", "Backus", "Wilson", "Wirth", "Borg",
        "Knuth", "Lamport", "Keller"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Toronto", "Krakow", "Austin", "Porto", "Accra", "Dublin",
          "Hanoi", "Quito", "Perth", "Seville", "Tartu"]
PRODUCTS = ["keyboard", "monitor", "desk lamp", "notebook", "backpack", "headphones", "coffee grinder", "kettle",
            "bicycle bell", "umbrella", "water bottle", "chess set", "tea pot", "phone case", "sketchbook"]
COLORS = ["red", "blue", "green", "black", "white", "silver", "orange", "teal"]
TAGS = ["admin", "beta", "vip", "new", "trial", "staff", "partner", "archived"]
EVENTS = ["login", "logout", "purchase", "refund", "signup", "password_reset", "upload", "download"]
STATUS = ["pending", "shipped", "delivered", "cancelled", "returned"]


def _record(rng: random.Random, kind: str) -> dict:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    if kind == "user":
        return {"id": rng.randint(1, 99999), "name": f"{first} {last}",
                "email": f"{first.lower()}.{last.lower()}@example.org", "age": rng.randint(18, 90),
                "city": rng.choice(CITIES), "active": rng.random() < 0.7,
                "tags": rng.sample(TAGS, rng.randint(0, 3))}
    if kind == "product":
        return {"sku": f"{rng.choice('ABCDEFGH')}{rng.randint(100, 999)}-{rng.randint(10, 99)}",
                "name": f"{rng.choice(COLORS)} {rng.choice(PRODUCTS)}", "price": round(rng.uniform(2, 400), 2),
                "currency": rng.choice(["EUR", "USD", "GBP"]), "in_stock": rng.randint(0, 500),
                "rating": round(rng.uniform(1, 5), 1)}
    if kind == "order":
        items = [{"product": rng.choice(PRODUCTS), "quantity": rng.randint(1, 5),
                  "unit_price": round(rng.uniform(2, 200), 2)} for _ in range(rng.randint(1, 4))]
        return {"order_id": rng.randint(10000, 99999), "customer": f"{first} {last}", "items": items,
                "status": rng.choice(STATUS), "date": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"}
    return {"event": rng.choice(EVENTS), "user_id": rng.randint(1, 99999), "city": rng.choice(CITIES),
            "timestamp": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:"
                         f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z",
            "duration_ms": rng.randint(1, 5000)}


def make_json_records(n_docs: int, seed: int = 0) -> list[str]:
    """Documents of 1–6 made-up records each, one JSON object per line or pretty-printed."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        kind = rng.choice(["user", "product", "order", "event"])
        records = [_record(rng, kind) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.5:
            docs.append("\n".join(json.dumps(r) for r in records))
        else:
            docs.append(json.dumps(records, indent=2))
    return docs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--python-bytes", type=int, default=12_000_000)
    ap.add_argument("--json-docs", type=int, default=12000)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    kinds = {"python": python_sources(args.python_bytes), "docs": python_docs(), "fortune": fortunes(),
             "json": make_json_records(args.json_docs)}
    for kind, docs in kinds.items():
        with open(args.out / f"{kind}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
        print(f"{kind}: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.2f} MB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
