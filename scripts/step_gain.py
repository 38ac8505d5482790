#!/usr/bin/env python3
"""What speculative drafts gained per step, priced against the steps beside them.

On a shared machine a whole bench run can be a third faster or slower than the
next, so `off` and `ngram` passes minutes apart compare the machine as much as
the drafts. This reads the engine's step events instead
(`SIPP_LOG=sipp::step=debug sipp bench ... 2> steps.log`) and prices each
drafted step's tokens at what the nearest undrafted steps of the same number of
decoding slots paid per token, within seconds of it. The gain is the priced
time over the time the steps took: 1.0 means the drafts paid exactly for their
rows.

    python3 scripts/step_gain.py steps.log [--slots 8] [--near 6]

Steps are grouped by the bench scenario they ran in (the bench marks each
scenario's start in the same log) and by their number of decoding slots;
groups of fewer than 50 steps are left out unless `--slots` names them.
"""

import argparse
import bisect
import re
import statistics
import sys
from collections import defaultdict

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELD = re.compile(r"(\w+)=(\d+)")
SCENARIO = re.compile(r"sipp::step: scenario (.+)$")
KEYS = ("slots", "prompt_rows", "decode_rows", "drafted", "accepted", "ns")


def steps(lines):
    """Each `sipp::step` event's fields, in order, with the scenario `sipp
    bench` had started then (its `scenario ...` events; "" before any)."""
    scenario = ""
    for line in lines:
        line = ANSI.sub("", line).rstrip("\n")
        if "sipp::step" not in line:
            continue
        if m := SCENARIO.search(line):
            scenario = m.group(1)
            continue
        f = {k: int(v) for k, v in FIELD.findall(line)}
        if all(k in f for k in KEYS):
            f["scenario"] = scenario
            yield f


def bucket(drafted):
    for top in (1, 2, 3, 4, 8, 16, 32):
        if drafted <= top:
            return top
    return 64


def gain(decode, near):
    """(priced ns, actual ns) over `decode` (steps of one slot count, no
    prompt rows), per bucket of drafted tokens (0: undrafted)."""
    plain = [i for i, s in enumerate(decode) if s["drafted"] == 0]
    out = defaultdict(lambda: [0.0, 0.0, 0, 0, 0])
    for i, s in enumerate(decode):
        b = out[bucket(s["drafted"]) if s["drafted"] else 0]
        if s["drafted"] == 0:
            priced = s["ns"]
        else:
            at = bisect.bisect(plain, i)
            around = sorted(plain[max(0, at - near) : at + near], key=lambda j: abs(j - i))[:near]
            if not around:
                continue
            per_token = statistics.median(decode[j]["ns"] for j in around) / s["slots"]
            priced = (s["slots"] + s["accepted"]) * per_token
        b[0] += priced
        b[1] += s["ns"]
        b[2] += 1
        b[3] += s["drafted"]
        b[4] += s["accepted"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", nargs="?", help="the log (default: standard input)")
    ap.add_argument("--slots", type=int, help="only steps of this many decoding slots")
    ap.add_argument("--near", type=int, default=6, help="undrafted steps to price against")
    a = ap.parse_args()
    log = open(a.log, encoding="utf-8", errors="replace") if a.log else sys.stdin
    groups = defaultdict(list)
    for s in steps(log):
        if s["prompt_rows"] == 0 and s["slots"] > 0:
            groups[(s["scenario"], s["slots"])].append(s)
    if not groups:
        sys.exit("no sipp::step events with decoding slots (run with SIPP_LOG=sipp::step=debug)")
    # Headings only for a bench's log (a plain run has no scenarios).
    heading = None if any(sc for sc, _ in groups) else ""
    for scenario, slots in groups:
        if a.slots is not None and slots != a.slots:
            continue
        decode = groups[(scenario, slots)]
        if a.slots is None and len(decode) < 50:
            continue
        g = gain(decode, a.near)
        priced = sum(v[0] for v in g.values())
        actual = sum(v[1] for v in g.values())
        if actual == 0:
            continue  # every step drafted: nothing to price them against
        if scenario != heading:
            print(f"{scenario or 'before the first scenario'}:")
            heading = scenario
        drafted = sum(v[3] for v in g.values())
        accepted = sum(v[4] for v in g.values())
        print(
            f"{slots} slots: {len(decode)} steps, gain {priced / actual:.3f}, "
            f"{drafted} drafted, {accepted / max(drafted, 1):.2f} accepted"
        )
        for b in sorted(g):
            p, t, n, d, acc = g[b]
            label = "undrafted" if b == 0 else f"drafted <= {b}"
            print(
                f"  {label:>14}: {n:5} steps, {100 * t / actual:5.1f}% of the time, "
                f"gain {p / t:.3f}, {acc / max(n, 1):5.1f} accepted a step"
            )


if __name__ == "__main__":
    main()
