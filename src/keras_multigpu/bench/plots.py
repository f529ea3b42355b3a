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
    bar_ax.bar(names, [table[n]["images_per_second"]["median"] for n in names],
               yerr=[[table[n]["images_per_second"]["median"] - table[n]["images_per_second"]["min"]
                      for n in names],
                     [table[n]["images_per_second"]["max"] - table[n]["images_per_second"]["median"]
                      for n in names]], capsize=3)
    bar_ax.set_ylabel("images/s (median, min-max)")
    bar_ax.tick_params(axis="x", rotation=45)
    virtual = " (virtual CPU devices)" if results["virtual_cpu_devices"] else ""
    figure.suptitle(f"{results['spec']['model']} on {results['machine']['cpu']}{virtual}")
    _save(figure, os.path.join(output, "bench.png"))
