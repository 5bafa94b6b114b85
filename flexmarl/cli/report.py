"""`flexmarl report RUN_DIR`: one self-contained HTML page of a run, with PNG pictures.

Learning curves per agent, training diagnostics, rollout/training busy fractions over time,
throughput, a Gantt chart of the real run drawn from trace.json (the simulator's Gantt code,
`flexmarl.sim.simulate.write_gantt`, reused), the rollout plan of each iteration, the doctor's
findings and the config. The PNGs are embedded (base64) and also written next to the page.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from types import SimpleNamespace

from flexmarl.cli.doctor import Run, diagnose, load_run
from flexmarl.config.schema import ConfigError
from flexmarl.sim.simulate import write_gantt
from flexmarl.telemetry.recorder import read_trace
from flexmarl.telemetry.samples import clip_text


def _plt():
    import matplotlib  # optional dependency: the optional `plots` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency: the optional `plots` extra

    return plt


def _curves(run: Run, path: Path, panels: list[tuple[str, list[tuple[str, str]]]],
            x_key: str = "iteration", x_label: str = "iteration") -> Path | None:
    """One subplot per panel, one line per (label, metric key) present in the records."""
    plt = _plt()
    shown = [(title, [(lab, k) for lab, k in lines if run.series(k)[1]]) for title, lines in panels]
    shown = [(t, lines) for t, lines in shown if lines]
    if not shown:
        return None
    cols = min(2, len(shown))
    rows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(shown):]:
        ax.set_visible(False)
    for ax, (title, lines) in zip(axes.flat, shown, strict=False):
        for label, key in lines:
            xs, ys = [], []
            for r in run.records:
                v, x = r.get(key), r.get(x_key)
                if isinstance(v, (int, float)) and isinstance(x, (int, float)):
                    xs.append(x)
                    ys.append(v)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(x_label, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _gantt(run: Run, path: Path) -> Path | None:
    """trace.json's spans, drawn by the simulator's Gantt code (one lane per worker)."""
    trace = read_trace(run.path / "trace.json")
    if trace is None:
        return None
    agents = run.agents
    spans = []
    for span in trace[0]:
        agent = span.label.split(":")[1] if ":" in span.label else ""
        if span.pool in ("rollout", "train") and agent in agents:
            spans.append(SimpleNamespace(lane=f"{span.pool}/{span.worker}", agent=agent,
                                         pool=span.pool, start=span.start, end=span.end))
    if not spans:
        return None
    t0 = min(s.start for s in spans)  # the trace's clock starts before the workers do
    for s in spans:
        s.start, s.end = s.start - t0, s.end - t0

    horizon = max(s.end for s in spans)
    n = max(len(run.records), 1)
    busy = [r.get("pool/train/busy_frac", 0.0) for r in run.records]
    result = SimpleNamespace(
        system=f"{run.config.get('name', run.path.name)} (real run, trace.json)",
        makespan_s=horizon, per_iteration_s=horizon / n,
        utilisation=sum(busy) / len(busy) if busy else 0.0,
        runtime=SimpleNamespace(spans=spans,
                                wl=SimpleNamespace(agents=[SimpleNamespace(name=a)
                                                           for a in agents])))
    write_gantt([result], path, xlabel="seconds since the first span")  # type: ignore[list-item]
    return path


def _img(path: Path | None, alt: str) -> str:
    if path is None or not path.exists():
        return f'<p class="none">({alt}: no data in this run)</p>'
    data = base64.b64encode(path.read_bytes()).decode()
    return (f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
            f'<figcaption>{html.escape(alt)} ({path.name})</figcaption></figure>')


def _plans_table(run: Run) -> str:
    rows = []
    for r in run.records:
        plan = r.get("rollout/plan")
        if not isinstance(plan, dict):
            continue
        replicas = plan.get("replicas", {})
        share = plan.get("share", {})
        cells = "; ".join(f"{a}: replicas {replicas.get(a)} share {share.get(a, 0):.2f}"
                          for a in sorted(set(replicas) | set(share)))
        rows.append(f"<tr><td>{r['iteration']}</td><td>{html.escape(str(plan.get('mode', '')))}"
                    f"</td><td>{html.escape(cells)}</td></tr>")
    if not rows:
        return '<p class="none">(no rollout plans recorded)</p>'
    return ("<table><tr><th>iteration</th><th>mode</th><th>agents on replicas</th></tr>"
            + "".join(rows) + "</table>")


def _samples_table(run: Run) -> str:
    """The first and the last iteration's samples of each agent: prompt, answer, reward."""
    if not run.samples:
        return "<p>no samples kept (logging.samples_per_agent: 0, or a run from before it)</p>"
    first, last = run.samples[0]["iteration"], run.samples[-1]["iteration"]
    rows = []
    for sample in run.samples:
        if sample["iteration"] not in (first, last):
            continue
        adv = sample.get("advantage")
        cells = [str(sample["iteration"]), sample["agent"], sample["node"],
                 clip_text(sample["prompt"], 300), clip_text(sample["answer"], 300),
                 f"{sample.get('reward')}", f"{adv:+.3f}" if isinstance(adv, (int, float))
                 else "-"]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("iteration", "agent", "node", "prompt (end)",
                                              "answer", "reward", "advantage"))
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _summary_table(run: Run) -> str:
    last = run.records[-1] if run.records else {}
    items = [
        ("status", run.summary.get("status", "(no summary.json: running or killed)")),
        ("iterations", len(run.records)),
        ("agents", ", ".join(run.agents)),
        ("final task/success_rate", f"{last.get('task/success_rate', 0.0):.3f}" if last else "-"),
        ("time", f"{last.get('time_s', 0.0):.1f} s" if last else "-"),
        ("failed episodes", int(sum(r.get("episodes/failed", 0) or 0 for r in run.records))),
    ]
    if run.summary.get("error"):
        items.append(("error", run.summary["error"]))
    return "<table>" + "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}"
                               "</td></tr>" for k, v in items) + "</table>"


CSS = """body{font-family:sans-serif;margin:2em auto;max-width:1300px;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ccc;padding:.25em .6em;
text-align:left}img{max-width:100%;border:1px solid #eee}figure{margin:1em 0}
figcaption{font-size:.8em;color:#666}pre{background:#f6f6f6;padding:1em;overflow:auto;
font-size:.8em}.error{color:#a00}.warning{color:#a60}.none{color:#888}
.finding{margin:.6em 0;padding:.5em .8em;background:#fafafa;border-left:4px solid #ccc}"""


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    run = load_run(run_dir)
    if not run.records:
        raise ConfigError(f"{run.path}: metrics.jsonl has no iteration records yet; nothing to "
                          "report")
    out_dir = Path(out) if out else run.path / "report"
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir}: exists and is not a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    agents, trainable = run.agents, run.trainable()

    def per_agent(metric: str, who: list[str] = agents) -> list[tuple[str, str]]:
        return [(a, f"agent/{a}/{metric}") for a in who]

    learning = _curves(run, out_dir / "learning_curves.png", [
        ("task/success_rate", [("success rate", "task/success_rate")]),
        ("reward_mean per agent", per_agent("reward_mean")),
    ])
    diagnostics = _curves(run, out_dir / "training.png", [
        ("entropy", per_agent("entropy", trainable)),
        ("grad_norm (before clipping)", per_agent("grad_norm", trainable)),
        ("clip_frac", per_agent("clip_frac", trainable)),
        ("kl", per_agent("kl", trainable)),
    ])
    busy = _curves(run, out_dir / "busy.png", [
        ("busy fraction per pool", [("rollout", "pool/rollout/busy_frac"),
                                    ("train", "pool/train/busy_frac")]),
        ("seconds per iteration", [("wall_s", "wall_s"), ("rollout makespan",
                                                          "rollout/makespan_s")]),
        ("training slots (per record)", [("slot wait s", "pool/train/slot_wait_s"),
                                         ("swap s", "pool/train/swap_s"),
                                         ("swaps", "pool/train/swaps")]),
    ], x_key="time_s", x_label="run time (s)")
    throughput = _curves(run, out_dir / "throughput.png", [
        ("rollout tokens/s per agent", per_agent("tokens_per_s")),
        ("trainer tokens/s per agent", per_agent("train_tokens_per_s", trainable)),
        ("trainer samples/s per agent", per_agent("train_samples_per_s", trainable)),
        ("episode latency", [("p50", "rollout/episode_latency_p50_s"),
                             ("p95", "rollout/episode_latency_p95_s")]),
    ])
    gantt = _gantt(run, out_dir / "gantt.png")
    findings = diagnose(run)
    finding_html = "".join(
        f'<div class="finding"><b class="{f.severity}">{html.escape(f.severity.upper())}: '
        f"{html.escape(f.problem)}</b>{' [' + html.escape(f.agent) + ']' if f.agent else ''}"
        f"<br>evidence: <code>{html.escape(f.metric)}</code> {html.escape(f.evidence)}"
        f"<br>remedy: {html.escape(f.remedy)}</div>" for f in findings
    ) or "<p>no problems found</p>"
    try:
        config_text = (run.path / "config.yaml").read_text()
    except OSError:
        config_text = "(no config.yaml)"
    name = run.config.get("name", run.path.name)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>flexmarl report: {html.escape(str(name))}</title>
<style>{CSS}</style></head><body>
<h1>flexmarl run report: {html.escape(str(name))}</h1>
<p>{html.escape(str(run.path))}</p>
{_summary_table(run)}
<h2 id="doctor">Doctor</h2>{finding_html}
<h2 id="learning">Learning curves</h2>{_img(learning, "learning curves per agent")}
<h2 id="training">Training diagnostics</h2>
{_img(diagnostics, "entropy, gradient norm, clip fraction, KL")}
<h2 id="busy">Where the time went</h2>{_img(busy, "rollout/training busy fractions over time")}
{_img(gantt, "Gantt chart of the run (trace.json): rollout solid, training hatched")}
<h2 id="throughput">Throughput</h2>{_img(throughput, "rollout and trainer throughput")}
<h2 id="samples">What the agents said (first and last iteration)</h2>{_samples_table(run)}
<h2 id="plans">Plan of each iteration</h2>{_plans_table(run)}
<h2 id="config">Config</h2><pre>{html.escape(config_text)}</pre>
</body></html>
"""
    path = out_dir / "index.html"
    path.write_text(page)
    return path
