"""The report of a benchmark run: the targets judged from what was measured, and the
Markdown tables (``format_report``) that ``jetloop bench`` prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from jetloop.tooling.bench.limits import LimitsResult, format_limits
from jetloop.tooling.bench.peer import JETLOOP, RESTATE, PeerResult, format_peer
from jetloop.tooling.bench.profile import ProfileResult

# --- engine overhead -----------------------------------------------------------------------


if TYPE_CHECKING:
    from jetloop.tooling.bench.run import HistoryRow, OverheadResult, ThroughputRow, WaitingResult


@dataclass
class Target:
    """A target of issue 7 and what this run measured against it."""

    name: str
    target: str
    measured: str
    met: bool


@dataclass
class BenchReport:
    """Everything one ``run_benchmarks`` measured, and the targets judged from it."""

    machine: dict[str, str]
    overhead: OverheadResult | None = None
    throughput: list[ThroughputRow] | None = None
    history: list[HistoryRow] | None = None
    waiting: WaitingResult | None = None
    profile: ProfileResult | None = None
    peer: PeerResult | None = None
    limits: LimitsResult | None = None
    targets: list[Target] = field(default_factory=list)
    wall_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.overhead is not None:
            data["overhead"]["ratios"] = [
                {"turn": r.turn, "load": r.load, "p50": r.ratio_p50, "p99": r.ratio_p99}
                for r in self.overhead.rows
            ]
        return data


def judge(rep: BenchReport) -> list[Target]:
    """The issue's targets against what was measured (only those measured)."""
    out: list[Target] = []
    if rep.overhead is not None:
        seq7 = next(r for r in rep.overhead.rows if r.turn == "7-step" and r.load == "sequential")
        out.append(
            Target(
                "7-step turn latency",
                "≤ 6 ms p50",
                f"{seq7.engine.p50_ms:.1f} ms p50 (floor {seq7.floor.p50_ms:.1f} ms)",
                seq7.engine.p50_ms <= 6.0,
            )
        )
        worst = max(rep.overhead.rows, key=lambda r: r.ratio_p50)
        out.append(
            Target(
                "engine overhead per step",
                "≤ 3× the raw floor",
                f"{seq7.ratio_p50:.2f}× (7-step, sequential, p50); worst {worst.ratio_p50:.2f}×"
                f" ({worst.turn}, {worst.load})",
                worst.ratio_p50 <= 3.0,
            )
        )
    if rep.throughput is not None:
        best = max(
            (r for r in rep.throughput if r.what.startswith("engine")), key=lambda r: r.steps_per_s
        )
        out.append(
            Target(
                "throughput",
                "≥ 3,000 steps/s",
                f"{best.steps_per_s:,.0f} steps/s ({best.what})",
                best.steps_per_s >= 3000,
            )
        )
    if rep.history is not None:
        by = {(h.history, h.turn): h for h in rep.history}
        small, large = sorted({h.history for h in rep.history})
        a, b = by[(small, "7-step")], by[(large, "7-step")]
        ratio = b.bytes_per_step / a.bytes_per_step
        out.append(
            Target(
                "bytes per step as history grows",
                f"at {large} ≤ 1.5× at {small}",
                f"{b.bytes_per_step:,.0f} vs {a.bytes_per_step:,.0f} B/step ({ratio:.2f}×)",
                ratio <= 1.5,
            )
        )
    if rep.waiting is not None:
        w = rep.waiting
        n = w.approvals + w.timers
        per_10k = (w.worker_rss_mb_parked - w.worker_rss_mb_before) * 10_000 / n
        out.append(
            Target(
                "worker memory of parked sessions",
                "< 50 MB for 10,000",
                f"{per_10k:+.1f} MB per 10,000 (measured on {n:,})",
                per_10k < 50,
            )
        )
    if rep.peer is not None and RESTATE in rep.peer.peers:
        seq, wide = rep.peer.rows[0], rep.peer.rows[-1]
        p50, p99, _ = seq.ratios(RESTATE)
        steps = wide.ratios(RESTATE)[2]
        out.append(
            Target(
                "jetloop against Restate (issue 15)",
                "≥ 0.6× its steps/s, ≤ 1.5× its p50, ≤ 2× its p99",
                f"{steps:.2f}× steps/s ({wide.load}), {p50:.2f}× p50, {p99:.2f}× p99 ({seq.load})"
                + (f"; jetloop on {rep.peer.workers} workers" if rep.peer.workers > 1 else ""),
                steps >= 0.6 and p50 <= 1.5 and p99 <= 2.0,
            )
        )
        spent = rep.peer.costs.get(wide.load, {}).get(JETLOOP)
        if spent is not None and spent.get("in_msgs") is not None:
            msgs_in, msgs_out = spent["in_msgs"] or 0.0, spent["out_msgs"] or 0.0
            out.append(
                Target(
                    "half the messages, past Restate (issue 37)",
                    "≥ 0.8× its steps/s, ≤ 1.2× its p50; ≤ 40 msgs in and ≤ 60 out per turn",
                    f"{steps:.2f}× steps/s, {p50:.2f}× p50; {msgs_in:.1f} in,"
                    f" {msgs_out:.1f} out ({wide.load})",
                    steps >= 0.8 and p50 <= 1.2 and msgs_in <= 40 and msgs_out <= 60,
                )
            )
    return out


def _ms(v: float) -> str:
    return f"{v:.1f}"


def format_report(rep: BenchReport) -> str:
    """The report as Markdown tables (what docs/performance.md shows)."""
    lines: list[str] = []
    m = rep.machine
    lines.append(
        f"Machine: {m.get('cpus')} CPUs, Python {m.get('python')}, {m.get('nats_server')},"
        f" load (1 min) at start {m.get('load_1m')}. Wall time {rep.wall_seconds:.0f} s."
    )
    if rep.overhead is not None:
        o = rep.overhead
        lines += ["", "### Engine overhead: turn latency (ms), engine against the raw floor", ""]
        lines.append(
            "| turn | load | engine p50 | engine p99 | floor p50 | floor p99 | ratio p50 |"
            " ratio p99 | turns |"
        )
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in o.rows:
            lines.append(
                f"| {r.turn} | {r.load} | {_ms(r.engine.p50_ms)} | {_ms(r.engine.p99_ms)} |"
                f" {_ms(r.floor.p50_ms)} | {_ms(r.floor.p99_ms)} | {r.ratio_p50:.2f}× |"
                f" {r.ratio_p99:.2f}× | {r.engine.n} |"
            )
        lines += ["", "Operations per turn (measured, not assumed):", ""]
        lines.append(
            "| turn | side | KV writes | stored publishes | deliveries acked |"
            " messages the worker sent | B per KV write | B per message |"
        )
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|")
        for side, ops in (("engine", o.engine_ops), ("floor", o.floor_ops)):
            for kind, c in ops.items():
                lines.append(
                    f"| {kind} | {side} | {c.kv_writes:.1f} | {c.publishes:.1f} | {c.acks:.1f} |"
                    f" {c.sent:.1f} | {c.kv_bytes} | {c.msg_bytes} |"
                )
        kinds = sorted(
            {k for mix in (*o.engine_mix.values(), *o.floor_mix.values()) for k in mix},
            key=lambda k: -o.engine_mix["7-step"].get(k, 0.0),
        )
        lines += ["", "What the worker sent the server per turn, by kind:", ""]
        shapes = list(o.engine_mix)
        lines.append("| kind | " + " | ".join(f"engine {s} | floor {s}" for s in shapes) + " |")
        lines.append("|---|" + "---:|" * (2 * len(shapes)))
        for k in kinds:
            cells = " | ".join(
                f"{o.engine_mix[s].get(k, 0.0):.1f} | {o.floor_mix[s].get(k, 0.0):.1f}"
                for s in shapes
            )
            lines.append(f"| {k} | {cells} |")
    if rep.throughput is not None:
        lines += ["", "### Throughput: 7-step turns on many concurrent sessions", ""]
        lines.append("| what | turns | in flight | wall s | steps/s | cores | turn p50 ms |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|")
        for t in rep.throughput:
            lines.append(
                f"| {t.what} | {t.turns} | {t.in_flight} | {t.wall_s:.1f} |"
                f" {t.steps_per_s:,.0f} | {t.cores} | {_ms(t.turn_p50_ms)} |"
            )
    if rep.history is not None:
        lines += ["", "### History growth", ""]
        lines.append(
            "| history (messages) | turn | p50 ms | p99 ms | durable bytes per step | turns |"
        )
        lines.append("|---:|---|---:|---:|---:|---:|")
        for h in rep.history:
            lines.append(
                f"| ~{h.history} | {h.turn} | {_ms(h.latency.p50_ms)} | {_ms(h.latency.p99_ms)} |"
                f" {h.bytes_per_step:,.0f} | {h.latency.n} |"
            )
    if rep.waiting is not None:
        w = rep.waiting
        lines += ["", "### Waiting at scale", ""]
        lines.append("| measure | value |")
        lines.append("|---|---:|")
        for k, v in asdict(w).items():
            lines.append(
                f"| {k.replace('_', ' ')} | {v:,.2f} |"
                if isinstance(v, float)
                else f"| {k.replace('_', ' ')} | {v:,} |"
            )
    if rep.peer is not None:
        lines += ["", format_peer(rep.peer)]
    if rep.limits is not None:
        lines += ["", format_limits(rep.limits)]
    if rep.profile is not None:
        p = rep.profile
        lines += ["", "### Profile of the worker on 7-step turns (pyinstrument, self time)", ""]
        lines.append("| where | share of all samples | share of busy samples |")
        lines.append("|---|---:|---:|")
        for k, v in p.categories.items():
            lines.append(f"| {k} | {v:.1%} | {p.busy_categories.get(k, 0.0):.1%} |")
        lines += ["", "Top functions by self time (share of busy samples):", ""]
        lines += [f"- {v:.1%} `{name}`" for name, v in p.top_self]
        lines += ["", "Handlers by cumulative time (share of busy samples):", ""]
        lines += [f"- {v:.1%} `{name}`" for name, v in p.handlers]
        lines.append(f"\nFull tree: {p.text_path}")
    if rep.targets:
        lines += [
            "",
            "### Targets",
            "",
            "| target | wanted | measured | verdict |",
            "|---|---|---|---|",
        ]
        for g in rep.targets:
            lines.append(
                f"| {g.name} | {g.target} | {g.measured} | {'met' if g.met else 'not met'} |"
            )
    return "\n".join(lines)
