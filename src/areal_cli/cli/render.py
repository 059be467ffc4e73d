"""Rich tables for a validated :class:`Plan` (imported only when printing one)."""

from __future__ import annotations

from areal_cli.allocation.plan import Plan


def _gb(x: float) -> str:
    if x < 0.01:
        return f"{x * 1024:.2f} MB"
    return f"{x:.2f} GB"


def _where(placement) -> str:
    parts = []
    for node, devs in placement:
        runs, start, prev = [], devs[0], devs[0]
        for d in devs[1:] + [None]:
            if d is not None and d == prev + 1:
                prev = d
                continue
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            if d is not None:
                start = prev = d
        parts.append(f"node{node}:[{','.join(runs)}]")
    return " ".join(parts)


def render_plan(plan: Plan, title: str = "plan", console=None) -> None:
    import sys

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = console or Console(width=None if sys.stdout.isatty() else 160)
    dev = "GPU" if plan.device == "cuda" else "CPU device"
    con.print(f"[bold green]✓ {title}[/]  spec [bold]{escape(plan.spec)}[/]  ·  {plan.n_devices_used}/"
              f"{plan.n_nodes * plan.n_devices_per_node} {dev}s on {plan.n_nodes} node(s)"
              + ("  ·  colocated" if plan.colocated else ""))
    comp = Table(title="components", title_justify="left")
    for col in ("role", "name", "backend", "dims", "devices", "placement node:\\[devices]"):
        comp.add_column(col)
    for p in plan.inferences:
        dims = f"d{p.dp} t{p.tp} p{p.pp}" + (f" e{p.ep}" if p.ep > 1 else "")
        comp.add_row("inference", p.name, p.backend, dims, str(p.n_devices), escape(_where(p.placement)))
    for t in plan.trains:
        s = t.parallel
        dims = f"d{s.dp} t{s.tp} p{s.pp} c{s.cp}" + (f" e{s.ep}" if s.ep > 1 and t.ffn is None else "")
        if t.ffn is not None:
            dims = f"attn {dims} | ffn d{t.ffn.dp} t{t.ffn.tp} p{t.ffn.pp} e{t.ffn.ep}"
        comp.add_row("train", t.name, t.backend, dims, str(t.n_devices), escape(_where(t.placement)))
    con.print(comp)
    if plan.trains:
        tr = Table(title="training, per device (estimates)", title_justify="left")
        for col in ("component", "seqs/step", "micro-batches", "weights", "grads", "optimizer",
                    "activations", "beside it", "total", "device"):
            tr.add_column(col, justify="left" if col == "component" else "right")
        for t in plan.trains:
            mb, m = t.micro_batch, t.memory
            if mb is None or m is None:
                continue
            total = _gb(t.total_gb)
            tr.add_row(t.name, str(mb.sequences), f"{mb.n_micro_batches} × ≤{mb.tokens_per_mb} tok" + (" (auto)" if mb.auto else ""),
                       _gb(m.weights_gb), _gb(m.grads_gb), _gb(m.optim_gb), _gb(m.activations_gb),
                       _gb(sum(t.companions)), f"[red]{total}[/]" if t.total_gb > m.device_gb else total,
                       _gb(m.device_gb))
        con.print(tr)
        if any(sum(t.companions) for t in plan.trains):
            con.print("beside it: frozen engines in the actor's process (KL reference, distillation teacher, reward "
                      "model) and a critic's weights, gradients and optimizer states", style="dim", highlight=False)
    if plan.inferences:
        inf = Table(title="inference, per device (estimates)", title_justify="left")
        for col in ("component", "devices/instance", "weights", "KV budget", "KV tokens", "needed",
                    "device"):
            inf.add_column(col, justify="left" if col == "component" else "right")
        for p in plan.inferences:
            m = p.memory
            if m is None:
                continue
            w = _gb(m.weights_gb)
            inf.add_row(p.name, str(p.tp * p.pp), f"[red]{w}[/]" if m.weights_gb > m.device_gb else w,
                        _gb(m.kv_budget_gb), f"{m.kv_tokens:,}", f"{m.kv_tokens_needed:,}",
                        _gb(m.device_gb))
        con.print(inf)
    for n in plan.notes:
        con.print(f"[cyan]note:[/] {escape(n)}", highlight=False)
    for w in plan.warnings:
        con.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
