"""Render `zerodp bench --json` files as the markdown tables of RESULTS.md.

    python benchmarks/to_markdown.py benchmarks/results/*.json
"""

from __future__ import annotations

import json
import sys


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _ratio(s: dict | None) -> str:
    return "-" if s is None else f"{s['median']:.2f} ({s['low']:.2f}-{s['high']:.2f})"


def spread_table(report: dict) -> str:
    """A report with spreads (`zerodp bench` with rounds): each mode's median and range of tokens/s, its
    ratios to DDP and FSDP2 round by round, and the verdicts."""
    load = ", ".join(f"{x:.1f}" for x in report.get("load_average_at_start") or [])
    lines = [f"`{report['command']}`", "",
             f"device: {report['device']}, torch {report['torch']}, commit {report.get('zerodp_commit')}, "
             f"load average at the start: {load}; at the end: "
             f"{', '.join(f'{x:.1f}' for x in report.get('load_average') or [])}", "",
             "| mode | world | tokens/s (median) | tokens/s min-max | vs DDP (median of rounds, min-max) "
             "| vs FSDP2 (median of rounds, min-max) | vs plain | exposed comm ms / step | loss first → last | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        own = report["spread"].get(r["mode"], {})
        tokens = own.get("tokens_per_s")
        span = "-" if tokens is None else f"{tokens['low']:,.0f}-{tokens['high']:,.0f}"
        loss = f"{r['losses'][0]:.3f} → {r['losses'][-1]:.3f}" if r["losses"] else "-"
        note = "; ".join(filter(None, [r["status"] if r["status"] != "ok" else "", r["reason"], r["note"]]))
        lines.append(f"| {r['mode']} | {r['world']} | {_f(r['tokens_per_s'], ',.0f')} | {span} "
                     f"| {_ratio(own.get('ddp'))} | {_ratio(own.get('fsdp2'))} | {_f(r['ratio_to_plain'], '.2f')} "
                     f"| {_f(r.get('exposed_comm_ms'), '.1f')} | {loss} | {note} |")
    lines += [""] + [f"- {v['sentence']}" for v in report["verdicts"]]
    return "\n".join(lines)


def table(report: dict) -> str:
    if "spread" in report:
        return spread_table(report)
    lines = [f"`{report['command']}`", "",
             f"device: {report['device']}, torch {report['torch']}, load average at the end: "
             f"{', '.join(f'{x:.1f}' for x in report.get('load_average') or [])}", "",
             "| mode | world | tokens/s (median) | tokens/s of each repeat | TFLOP/s per device | MFU "
             "| peak alloc / rsvd GiB | vs plain | loss first → last | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        samples = ", ".join(f"{s:,.0f}" for s in r.get("samples") or [])
        mfu = "n/a" if r["status"] == "ok" and r["mfu"] is None else _f(r["mfu"] and 100 * r["mfu"], ".1f")
        mem = "-" if r["peak_allocated_gib"] is None else \
            f"{r['peak_allocated_gib']:.1f} / {r['peak_reserved_gib']:.1f}"
        loss = f"{r['losses'][0]:.3f} → {r['losses'][-1]:.3f}" if r["losses"] else "-"
        note = "; ".join(filter(None, [r["status"] if r["status"] != "ok" else "", r["reason"], r["note"]]))
        lines.append(f"| {r['mode']} | {r['world']} | {_f(r['tokens_per_s'], ',.0f')} | {samples} "
                     f"| {_f(r['tflops'], '.4f')} | {mfu} | {mem} | {_f(r['ratio_to_plain'], '.2f')} "
                     f"| {loss} | {note} |")
    fake = report.get("fake_world") or []
    if fake:
        lines += ["", "| fake-world mode | as rank 0 of | peak alloc / rsvd GiB | model states MiB | breakdown |",
                  "|---|---|---|---|---|"]
        for r in fake:
            owned = r.get("owned_bytes") or {}
            total = owned.get("model_states", sum(owned.values()))
            parts = ", ".join(f"{k} {v / 2**20:,.2f}" for k, v in owned.items() if v and k != "model_states")
            mem = "-" if r["peak_allocated_gib"] is None else \
                f"{r['peak_allocated_gib']:.2f} / {r['peak_reserved_gib']:.2f}"
            lines.append(f"| {r['mode']} | {r['world']} | {mem} | {total / 2**20:,.2f} | {parts} |")
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            print(table(json.load(f)), end="\n\n")
