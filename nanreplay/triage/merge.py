"""`nanreplay triage --merge OUTDIR`: the parts that `--shard I/N` runs wrote (shard.py), joined into one index.

`merge()` reads every part.json present, orders the rows as one run over all of DIR would (so duplicates, groups and
the machine differential come out the same), and writes OUTDIR's own groups.json, summary.csv and index.html, whose
links point into the parts. Missing parts are named in the summary and in groups.json's "parts".

Light to import: no torch; pandas and jinja2 only when writing (as output.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nanreplay import __version__, interrupt
from nanreplay.errors import UsageError
from nanreplay.triage.groups import group_id, signature
from nanreplay.triage.lock import OutdirLock
from nanreplay.triage.output import SCHEMA, Result, save, tally
from nanreplay.triage.rows import COLUMNS, clean_row
from nanreplay.triage.shard import PART_DIR, PART_FILE, PART_SCHEMA, PARTS, listing_key, part_folder, part_name, span


def _read_parts(out: Path) -> tuple[int, dict[int, dict]]:
    """(N, {i: part.json}) of OUTDIR's parts; one clear line when there are none or they split DIR differently."""
    folder = out / PARTS
    found: dict[int, set[int]] = {}
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        raise UsageError(f"{out}: holds no parts to merge (run `nanreplay triage DIR -o {out} --shard I/N` first)"
                         ) from None
    for name in names:
        m = PART_DIR.fullmatch(name)
        if m and int(m.group(1)) < int(m.group(2)) and (folder / name / PART_FILE).is_file():
            found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    if not found:
        raise UsageError(f"{out}: holds no finished part to merge (run `nanreplay triage DIR -o {out} --shard I/N`)")
    if len(found) > 1:
        splits = ", ".join(f"{len(v)} of {k}" for k, v in sorted(found.items()))
        raise UsageError(f"{out}: holds parts of different splits ({splits}); remove {out / PARTS}'s parts of the "
                         "split you no longer use, then merge again")
    (n, present), = found.items()
    parts: dict[int, dict] = {}
    for i in sorted(present):
        f = part_folder(out, i, n) / PART_FILE
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"{f}: unreadable part ({e}); run that part again") from None
        if not isinstance(doc, dict) or doc.get("schema") != PART_SCHEMA or not isinstance(doc.get("rows"), list):
            raise UsageError(f"{f}: not a part this version of nanreplay wrote; run that part again")
        parts[i] = doc
    first = parts[min(parts)]
    for i, doc in parts.items():
        for k in ("dir", "options"):
            if doc.get(k) != first.get(k):
                raise UsageError(f"{out}: part {i} of {n} was run with another {k} ({doc.get(k)!r}, not "
                                 f"{first.get(k)!r}); run it again like the others")
    return n, parts


def merge(outdir: str) -> Result:
    """Join every part in OUTDIR/parts into OUTDIR's groups.json, summary.csv and index.html: a triage.Result
    whose doc["parts"] names the parts present and missing."""
    out = Path(outdir)
    if not out.is_dir():
        raise UsageError(f"{outdir}: no such folder")
    lock = OutdirLock(out).acquire()
    try:
        n, parts = _read_parts(out)
        keyed = []
        for i, doc in parts.items():
            prefix = f"{PARTS}/{part_name(i, n)}/"
            for raw in doc["rows"]:
                if not isinstance(raw, dict) or not isinstance(raw.get("file"), str):
                    continue
                folder = raw.pop("_folder", False) is True
                row = clean_row({**dict.fromkeys(COLUMNS), **raw})  # every column, of its type
                for k in ("report", "json"):  # the reports stay in their part: the links go there
                    if row.get(k):
                        row[k] = prefix + row[k]
                row["group"] = group_id(signature(row)) if row["status"] == "analyzed" else None
                keyed.append((listing_key(row["file"], folder), row))
        keyed.sort(key=lambda kr: kr[0])
        rows = [r for _, r in keyed]
        first_of: dict[str, str] = {}  # duplicates across parts, as plan.mark_duplicates over the whole listing
        for r in rows:
            sha = r.get("sha256")
            dup = first_of.setdefault(sha, r["file"]) if sha else r["file"]
            r["duplicate_of"] = dup if dup != r["file"] else ""
        ignored = sorted({f for doc in parts.values() for f in doc.get("ignored") or [] if isinstance(f, str)})
        tallied = tally(rows, len(ignored))
        missing = [i for i in range(n) if i not in parts]
        if missing:
            tallied["summary"] += f"; {len(missing)} of {n} parts missing: {span(missing)}"
        first = parts[min(parts)]
        opts = first.get("options") if isinstance(first.get("options"), dict) else {}
        doc = {"schema": SCHEMA, "nanreplay_version": __version__, "dir": str(first.get("dir") or ""),
               "options": {"model": opts.get("model"), "loss": opts.get("loss"), "trust": opts.get("trust") is True},
               **tallied, "ignored": ignored, "parts": {"of": n, "present": sorted(parts), "missing": missing}}
        with interrupt.deferred():
            return save(out, doc, rows, "merged outputs")
    finally:
        lock.release()
