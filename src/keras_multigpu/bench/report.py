"""`keras-multigpu bench`'s tables: the measured figures, the ratios against plain Keras, and
the projection to more GPUs and hosts, as text."""

import textwrap

FIGURES = ("images_per_second", "ms_per_step", "compiled_step_ms", "outside_step_ms",
           "compile_seconds", "peak_host_memory_mb", "fit_call_ms", "fit_call_images_per_second",
           "fit_call_outside_epochs_ms", "fit_call_compiles", "collectives_per_step",
           "collective_kb_per_step", "store_exchanges_per_step")


def format_table(results):
    lines = [f"{'setup':16}{'dev':>4}{'img/s':>10}{'min':>9}{'max':>9}{'ms/step':>9}"
             f"{'in step':>9}{'outside':>9}{'compile s':>10}{'eff.':>6}"]
    for name, row in results["table"].items():
        median = {k: float("nan") if row[k] is None else row[k]["median"] for k in FIGURES}
        ips = row["images_per_second"]
        lines.append(f"{name:16}{row['devices']:>4}{ips['median']:>10.1f}{ips['min']:>9.1f}"
                     f"{ips['max']:>9.1f}{median['ms_per_step']:>9.2f}"
                     f"{median['compiled_step_ms']:>9.2f}{median['outside_step_ms']:>9.2f}"
                     f"{median['compile_seconds']:>10.1f}"
                     f"{_efficiency(row):>6}")
    for name, reason in results["skipped"].items():
        lines.append(f"{name:16} skipped: {reason}")
    for name, errors in results.get("failures", {}).items():
        last = errors[-1].strip().splitlines()[-1]
        last = last if len(last) <= 150 else "..." + last[-147:]  # its end says why
        lines.append(f"{name:16} failed in {len(errors)} round(s); last: {last}")
    lines += _format_fit_calls(results)
    lines += _format_collectives(results)
    lines.append("")
    lines += [f"{name:32} {value:.3f}" for name, value in results["ratios"].items()]
    if results.get("fit_call_ratios"):
        lines.append("Per fit call:")
        lines += [f"{name:32} {value:.3f}" for name, value in results["fit_call_ratios"].items()]
    if results["projection"]:
        lines += ["", *format_projection(results["projection"]).splitlines()]
    if results.get("verdicts"):
        lines += ["", "Verdict (DeviceMonitor in each worker; see docs/monitor.md):",
                  *results["verdicts"]]
    return "\n".join(lines)


def _efficiency(row):
    """The row's speed-up over ours-1 (else plain-1) per device; "-" without either."""
    return "-" if row.get("efficiency") is None else f"{row['efficiency']:.2f}"


def _percent(value):
    return f"{100 * value:.1f}"


def format_projection(p):
    """The cost model's tables: one host, several hosts, Horovod's published figures."""
    lines = _wrap(f"Projected efficiency from {p['source']} ({p['compute_ms']:.2f} ms, "
                  f"{p['grad_bytes'] / 1e6:.1f} MB of gradients); modelled, not measured; "
                  f"assumptions: {p['assumptions']}")
    for row in p["rows"]:
        lines.append(f"  {row['link']:22} {row['devices']:>3} GPUs: "
                     f"{100 * row['efficiency']:5.1f} % (no overlap), "
                     f"{100 * row['efficiency_overlap']:5.1f} % (overlap)")
    multi = p.get("multi_host")
    if multi:
        lines += ["", *_wrap(f"Several hosts, {multi['gpus_per_host']} GPUs each (modelled, "
                             f"not measured; {p['parameters'] / 1e6:.2f} M parameters, "
                             f"{p['compute_ms']:.2f} ms step; flat ring and hierarchical "
                             f"all-reduce; efficiency without and with overlap); assumptions: "
                             f"{multi['assumptions']}"),
                  *_host_table(multi["rows"])]
    horovod = p.get("horovod")
    if horovod:
        published = ", ".join(f"{name} {_percent(v)} %" for name, v in horovod["published"].items())
        lines += ["", *_wrap(f"Beside Horovod: our model (not a measurement) for "
                             f"ResNet-101-sized gradients ({horovod['parameters'] / 1e6:.1f} M "
                             f"fp32 parameters, {horovod['grad_bytes'] / 1e6:.0f} MB); "
                             f"{horovod['step_assumption']}."),
                  *_wrap(f"Horovod's published efficiency (measured by Uber on 4 Pascal GPUs "
                         f"per host and 25 GbE; the last column gives its ResNet-101 figure "
                         f"at the row's GPU count): {published}. Source: {horovod['source']}"),
                  *_host_table(horovod["rows"], extra=True)]
    return "\n".join(lines)


def _wrap(text):
    return textwrap.wrap(text, width=100, break_on_hyphens=False)


def _host_table(rows, extra=False):
    head = (f"{'link + network':34}{'hosts':>6}{'GPUs':>6}{'flat ms':>10}{'hier ms':>10}"
            f"{'flat %':>8}{'+ovl':>7}{'hier %':>8}{'+ovl':>7}")
    if extra:
        head += f"{'step for 90 %':>15}{'Horovod %':>11}"
    lines = [head]
    for r in rows:
        line = (f"{r['cluster']:34}{r['hosts']:>6}{r['gpus']:>6}{r['flat_ms']:>10.2f}"
                f"{r['hierarchical_ms']:>10.2f}{_percent(r['efficiency_flat']):>8}"
                f"{_percent(r['efficiency_flat_overlap']):>7}"
                f"{_percent(r['efficiency_hierarchical']):>8}"
                f"{_percent(r['efficiency_hierarchical_overlap']):>7}")
        if extra:
            published = r["published_resnet101"]
            line += (f"{r['step_ms_for_90_percent']:>12.1f} ms"
                     f"{'-' if published is None else _percent(published):>11}")
        lines.append(line)
    return lines


def _format_collectives(results):
    """The per-step communication of the setups that count it: torch's process groups,
    JAX's compiled steps and TensorFlow's traced steps."""
    rows = {name: row for name, row in results["table"].items()
            if row.get("collectives_per_step") is not None}
    if not rows:
        return []
    lines = ["", "Collectives per step (torch.distributed: counted in rank 0 over the first fit "
                 "call, DDP's buckets from its logging data; store: exchanges through the "
                 "process group's store. JAX: in the compiled step's optimised HLO, after XLA "
                 "combined them. TensorFlow: the strategy's reductions and broadcasts "
                 "traced into the step):",
             f"{'setup':16}{'dev':>4}{'collectives':>13}{'KiB':>10}{'store':>8}"]
    for name, row in rows.items():
        store = row["store_exchanges_per_step"]
        lines.append(f"{name:16}{row['devices']:>4}"
                     f"{row['collectives_per_step']['median']:>13.2f}"
                     f"{row['collective_kb_per_step']['median']:>10.1f}"
                     f"{'-' if store is None else format(store['median'], '.2f'):>8}")
    return lines


def _format_fit_calls(results):
    """The per-call block of the table: whole `fit` calls of a warm model."""
    rows = {name: row for name, row in results["table"].items() if row.get("fit_call_ms")}
    if not rows:
        return []
    spec = results["spec"]
    lines = ["", f"Whole fit calls after a warm-up fit ({spec.get('fit_calls')} calls of "
                 f"{spec.get('fit_epochs')} epoch(s) each; medians over rounds):",
             f"{'setup':16}{'dev':>4}{'ms/call':>10}{'min':>10}{'max':>10}{'img/s':>10}"
             f"{'outside epochs ms':>19}{'compiles':>9}"]
    for name, row in rows.items():
        call, ips = row["fit_call_ms"], row["fit_call_images_per_second"]
        outside = row["fit_call_outside_epochs_ms"]["median"]
        compiles = row["fit_call_compiles"]
        lines.append(f"{name:16}{row['devices']:>4}{call['median']:>10.1f}{call['min']:>10.1f}"
                     f"{call['max']:>10.1f}{ips['median']:>10.1f}{outside:>19.2f}"
                     f"{'-' if compiles is None else int(compiles['max']):>9}")
    return lines
