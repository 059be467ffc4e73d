"""Rich tables for ``areal plan``: memory per component, the step's time terms, throughput, the bottleneck
and ``--suggest``'s search (imported only when printing)."""

from __future__ import annotations

import sys

from areal_cli.cli.render import _gb


def _console(console=None):
    from rich.console import Console

    return console or Console(width=None if sys.stdout.isatty() else 160)


def _s(x: float) -> str:
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs" if x > 0 else "0"
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def render_run_plan(rp, plan, console=None, lengths: str | None = None) -> None:
    from rich.markup import escape
    from rich.table import Table

    con = _console(console)
    hw = rp.hardware
    w = rp.workload
    con.print(f"[bold]plan[/] spec [bold]{escape(rp.spec)}[/] on [bold]{escape(hw.name)}[/] "
              f"({escape(hw.source or hw.kind)})", highlight=False)
    con.print(f"per step: {w['prompts']} prompts × {w['group_size']} = {w['samples']} samples, "
              f"~{w['prompt_tokens']:.0f} prompt + {w['new_tokens']:.0f} new tokens each, "
              f"staleness bound k={w['staleness']}", highlight=False)
    con.print(f"prompt lengths: {escape(lengths)}" if lengths else
              "prompt lengths: half of dataset.max_prompt_len (the dataset or tokenizer is not on this machine, "
              "or --caps)", style="dim", highlight=False)
    mem = Table(title="memory per device (one process; estimates)", title_justify="left")
    for col in ("component", "kind", "dims", "devices", "weights", "grads", "optimizer", "activations",
                "KV cache", "buffers", "process", "typical", "device", "binds first"):
        mem.add_column(col, justify="left" if col in ("component", "kind", "dims", "binds first") else "right")
    for c in rp.components:
        m = c.memory
        proc = _gb(m.process_gb)
        mem.add_row(escape(c.name), c.kind, c.dims, str(c.n_devices), _gb(m.weights_gb), _gb(m.grads_gb),
                    _gb(m.optim_gb), _gb(m.activations_gb), _gb(m.kv_cache_gb), _gb(m.buffers_gb),
                    proc if m.fits else f"[red]{proc}[/]", _gb(m.expected_gb), _gb(m.device_gb), escape(m.binds))
    con.print(mem)
    con.print("process: at the length caps (what must fit); typical: at the mean lengths (a usual step's "
              "peak)", style="dim", highlight=False)
    s = rp.step
    st = Table(title=f"one RL step ({s.mode}: what this config runs)", title_justify="left")
    st.add_column("term")
    st.add_column("time", justify="right")
    st.add_column("what it is")
    gen = rp.terms.get("generation") or {}
    st.add_row("generation", _s(s.gen_s), f"one server instance's share: {gen.get('concurrency', 0)} sequences "
               f"at once, {_s(gen.get('iter_s', 0.0))} per decode iteration ({gen.get('bound', '-')})")
    st.add_row("  prefill", _s(s.prefill_s), "prompt tokens × 2N FLOPs (one prefill per group)")
    st.add_row("  decode", _s(s.decode_s), "new tokens × decode iterations")
    st.add_row("rewards", _s(s.reward_s), "")
    train = rp.terms.get("train") or {}
    parts = train.get("parts", {})
    big = ", ".join(f"{k} {_s(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:3] if v > 0)
    st.add_row("training", _s(s.train_s), big)
    sync = rp.terms.get("weight_sync") or {}
    st.add_row("weight sync", _s(s.sync_s), f"{sync.get('mode', '-')}, {_gb(sync.get('bytes', 0) / 1024 ** 3)}")
    st.add_row("[bold]step, sync[/]", _s(s.sync_step_s), "generation + rewards + training + sync")
    st.add_row("[bold]step, async[/]", _s(s.async_step_s),
               "generation overlapped with training, + sync" + (" (sharing the host's cores)"
                                                               if hw.shared_compute else ""))
    con.print(st)
    util = "  ".join(f"{escape(c.name)} {c.utilisation:.0%}" for c in rp.components if c.busy_s > 0)
    con.print(f"[bold]{rp.samples_per_s:,.1f} samples/s[/]  ·  {rp.tokens_per_s:,.0f} generated tokens/s  ·  "
              f"{rp.train_tokens_per_s:,.0f} trained tokens/s  ·  utilisation: {util}", highlight=False)
    con.print(f"[bold]bottleneck:[/] {escape(rp.bottleneck)}", highlight=False)
    for n in plan.notes:
        con.print(f"[cyan]note:[/] {escape(n)}", highlight=False)
    for msg in [*plan.warnings, *rp.warnings]:
        con.print(f"[yellow]warning:[/] {escape(msg)}", highlight=False)


def render_suggestion(sug, console=None) -> None:
    from rich.markup import escape
    from rich.table import Table

    con = _console(console)
    tb = Table(title=f"--suggest: {sug.searched} splits planned, {sug.refused} refused by the validator "
               f"({sug.elapsed_s:.2f} s)", title_justify="left")
    for col in ("spec", "samples/s", "step", "vs current", "bottleneck"):
        tb.add_column(col, justify="right" if col in ("samples/s", "step", "vs current") else "left")
    cur = sug.current.samples_per_s
    for c in sug.candidates:
        mark = " (current)" if c.spec == sug.current.spec else ""
        tb.add_row(escape(c.spec + mark), f"{c.samples_per_s:,.1f}", _s(c.step_s),
                   f"{c.samples_per_s / cur:.2f}×" if cur > 0 else "-", escape(c.bottleneck))
    con.print(tb)
    if sug.best.spec == sug.current.spec:
        con.print(f"[bold green]the current spec {escape(sug.current.spec)} is the best split found[/]",
                  highlight=False)
    else:
        con.print(f"[bold green]suggested:[/] {escape(sug.override)}  ({sug.gain:.2f}× the current "
                  f"{cur:,.1f} samples/s)", highlight=False)
