"""The benchmark's figures: throughput, efficiency, ours against the peers."""

import os

from keras_multigpu.plots import _save, plt


def draw(results, output):
    table = results["table"]
    engines = sorted({row["engine"] for row in table.values()})
    figure, (tput_ax, eff_ax, bar_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    for engine in engines:
        rows = sorted((r["devices"], r) for r in table.values() if r["engine"] == engine)
        counts = [n for n, _ in rows]
        tput_ax.plot(counts, [r["images_per_second"]["median"] for _, r in rows], "o-",
                     label=engine)
        if all("efficiency" in r for _, r in rows):
            eff_ax.plot(counts, [r["efficiency"] for _, r in rows], "o-", label=engine)
    projection = results.get("projection")
    if projection:
        for link in sorted({row["link"] for row in projection["rows"]}):
            rows = [r for r in projection["rows"] if r["link"] == link]
            eff_ax.plot([r["devices"] for r in rows], [r["efficiency_overlap"] for r in rows],
                        linestyle=":", label=f"projected, {link}")
    for ax, label in ((tput_ax, "images/s"), (eff_ax, "efficiency vs ours-1")):
        ax.set_xlabel("devices")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    names = list(table)
    figures = [("images_per_second", "steady epochs")]
    if all(table[n].get("fit_call_images_per_second") for n in names):
        figures.append(("fit_call_images_per_second", "whole fit calls"))
    width = 0.8 / len(figures)
    for i, (figure_name, label) in enumerate(figures):
        spreads = [table[n][figure_name] for n in names]
        bar_ax.bar([j + (i - (len(figures) - 1) / 2) * width for j in range(len(names))],
                   [s["median"] for s in spreads], width,
                   yerr=[[s["median"] - s["min"] for s in spreads],
                         [s["max"] - s["median"] for s in spreads]], capsize=3, label=label)
    bar_ax.set_xticks(range(len(names)), names, rotation=45)
    bar_ax.set_ylabel("images/s (median, min-max)")
    if len(figures) > 1:
        bar_ax.legend(fontsize=8)
    virtual = " (virtual CPU devices)" if results["virtual_cpu_devices"] else ""
    figure.suptitle(f"{results['spec']['model']} on {results['machine']['cpu']}{virtual}")
    _save(figure, os.path.join(output, "bench.png"))
