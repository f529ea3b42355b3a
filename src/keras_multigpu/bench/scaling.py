"""A cost model for data parallelism on GPUs this machine does not have.

Per step, each of N GPUs computes its share of the batch in `compute` seconds
(the measured one-device step, at the same per-device batch), then the
gradients (`grad_bytes`) are summed with a ring all-reduce:

    t_allreduce = 2 (N - 1) / N * grad_bytes / bandwidth + 2 (N - 1) * hop_latency

Without overlap the step takes compute + t_allreduce. With overlap the
all-reduce runs during the backward pass (taken as 2/3 of the step), and only
what does not fit behind it is exposed. Efficiency = compute / step time.
"""

LINKS = {
    # name: (bandwidth per direction in bytes/s, latency per ring hop in s)
    "NVLink 4 (H100 SXM)": (450e9, 5e-6),
    "PCIe Gen5 x16": (50e9, 10e-6),
    "PCIe Gen4 x16": (25e9, 10e-6),
}
BACKWARD_FRACTION = 2 / 3

ASSUMPTIONS = (
    "ring all-reduce of fp32 gradients once per step; link bandwidth per direction "
    "(NVLink 4: 450 GB/s; PCIe Gen5/Gen4 x16: 50/25 GB/s achievable of 64/32 "
    "theoretical) and per-hop latency 5 us (NVLink) or 10 us (PCIe); compute time per "
    "device unchanged with N (same per-device batch, weak scaling); the backward pass is "
    "2/3 of the step and is what an all-reduce can overlap; input pipeline never stalls."
)


def allreduce_seconds(grad_bytes, devices, bandwidth, hop_latency):
    if devices == 1:
        return 0.0
    return (2 * (devices - 1) / devices * grad_bytes / bandwidth
            + 2 * (devices - 1) * hop_latency)


def project(compute_seconds, grad_bytes, counts=(2, 4, 8, 16), links=None):
    """Projected efficiency per link and device count.

    A 1 ms step and 4 MB of gradients on 8 devices over a 100 GB/s link:
    the all-reduce moves 2 * 7/8 * 4 MB in 0.07 ms.

    >>> rows = project(1e-3, 4e6, counts=(8,), links={"x": (100e9, 0.0)})
    >>> round(rows[0]["allreduce_ms"], 3), round(rows[0]["efficiency"], 3)
    (0.07, 0.935)
    >>> rows[0]["efficiency_overlap"]  # 0.07 ms hides behind the backward pass
    1.0
    """
    rows = []
    for link, (bandwidth, latency) in (links or LINKS).items():
        for n in counts:
            comm = allreduce_seconds(grad_bytes, n, bandwidth, latency)
            exposed = max(0.0, comm - BACKWARD_FRACTION * compute_seconds)
            rows.append({
                "link": link, "devices": n, "allreduce_ms": 1000 * comm,
                "efficiency": compute_seconds / (compute_seconds + comm),
                "efficiency_overlap": compute_seconds / (compute_seconds + exposed),
            })
    return rows
