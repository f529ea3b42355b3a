"""A cost model for data parallelism on GPUs (and hosts) this machine does not have.

Every figure here is modelled, not measured.

One host, N GPUs. Per step, each GPU computes its share of the batch in
`compute` seconds (the measured one-device step, at the same per-device batch),
then the gradients (`grad_bytes`, S) are summed with a ring all-reduce over a
link of bandwidth B (per direction) and per-hop latency a:

    t_ring(N) = 2 (N - 1) / N * S / B + 2 (N - 1) * a

Several hosts: H hosts of G GPUs each (N = H * G). Inside a host the GPUs talk
over the intra-node link (B_in, a_in: NVLink or PCIe); between hosts over the
network (B_net, a_net per NIC: InfiniBand or Ethernet).

Flat ring over all N GPUs (the textbook ring, one ring): each of its 2 (N - 1)
steps moves S / N over every hop at once and ends when the slowest hop does,
so the slowest link sets the pace:

    t_flat = 2 (N - 1) * (S / (N * min(B_in, B_net)) + max(a_in, a_net))

(with H = 1 every hop is intra-node: t_flat = t_ring over B_in; with G = 1
every hop is a network hop). A single ring crosses each host boundary with
one flow, so it uses one NIC per host, whether the host has one or G.

Hierarchical all-reduce (as Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE does):
reduce-scatter inside each host, then G independent rings across hosts (GPU g
of every host), each all-reducing S / G, then an all-gather inside each host:

    t_rs = t_ag = (G - 1) / G * S / B_in + (G - 1) * a_in
    t_x  = 2 (H - 1) / H * (S / G) / b + 2 (H - 1) * a_net
    t_hier = t_rs + t_x + t_ag

where b is the network bandwidth one GPU gets: b = B_net with one NIC per GPU
(nic="gpu", as DGX H100's eight 400 Gb/s NICs), b = B_net / G with one NIC per
host that its G GPUs share (nic="node"). H = 1 gives t_ring(G) over B_in.

Which wins: with one NIC per GPU, t_hier <= t_flat whenever B_net <= B_in
(the bandwidth terms, times H G B_net / 2 S: H (G - 1) B_net / B_in + (H - 1)
against H G - 1), and its
latency term, 2 (G - 1) a_in + 2 (H - 1) a_net, is always the smaller. With
one NIC per host, the NIC carries about 2 S either way (2 (H - 1) / H * S
against 2 (N - 1) / N * S), so the hierarchical scheme gains latency, not
bandwidth, and its intra-node phases can make it the slower at large S.

Overlap, as for one host: without overlap a step takes compute + t; with it
the all-reduce runs during the backward pass (taken as 2/3 of the step) and
only what does not fit behind it is exposed:

    exposed = max(0, t - 2/3 * compute)
    efficiency = compute / (compute + t)           (no overlap)
    efficiency_overlap = compute / (compute + exposed)

See ASSUMPTIONS and MULTI_HOST_ASSUMPTIONS for what the figures leave out.
"""

LINKS = {
    # name: (bandwidth per direction in bytes/s, latency per ring hop in s)
    "NVLink 4 (H100 SXM)": (450e9, 5e-6),
    "PCIe Gen5 x16": (50e9, 10e-6),
    "PCIe Gen4 x16": (25e9, 10e-6),
}
# Intra-node links the multi-host model also knows (not in the single-host table).
OTHER_LINKS = {
    "PCIe Gen3 x16": (12e9, 10e-6),  # achievable of 16 GB/s theoretical (Pascal era)
}
NETWORKS = {
    # name: (bandwidth per NIC per direction in bytes/s at line rate, latency per hop in s)
    "InfiniBand NDR 400 Gb/s": (50e9, 5e-6),
    "InfiniBand HDR 200 Gb/s": (25e9, 5e-6),
    "100 GbE": (12.5e9, 20e-6),
    "25 GbE": (3.125e9, 30e-6),
}
NICS = {"gpu": "NIC per GPU", "node": "NIC per node"}
CLUSTERS = {
    # name: (intra-node link, network, NICs: "gpu" one per GPU, "node" one per host)
    "NVLink 4 + IB NDR, NIC per GPU": ("NVLink 4 (H100 SXM)", "InfiniBand NDR 400 Gb/s", "gpu"),
    "NVLink 4 + IB NDR, NIC per node": ("NVLink 4 (H100 SXM)", "InfiniBand NDR 400 Gb/s",
                                        "node"),
    "NVLink 4 + IB HDR, NIC per GPU": ("NVLink 4 (H100 SXM)", "InfiniBand HDR 200 Gb/s", "gpu"),
    "NVLink 4 + 100 GbE, NIC per node": ("NVLink 4 (H100 SXM)", "100 GbE", "node"),
    "PCIe Gen4 + 25 GbE, NIC per node": ("PCIe Gen4 x16", "25 GbE", "node"),
}
DEFAULT_HOSTS = (1, 2, 4, 16, 64)
DEFAULT_GPUS_PER_HOST = 8
BACKWARD_FRACTION = 2 / 3

ASSUMPTIONS = (
    "ring all-reduce of fp32 gradients once per step; link bandwidth per direction "
    "(NVLink 4: 450 GB/s; PCIe Gen5/Gen4 x16: 50/25 GB/s achievable of 64/32 "
    "theoretical) and per-hop latency 5 us (NVLink) or 10 us (PCIe); compute time per "
    "device unchanged with N (same per-device batch, weak scaling); the backward pass is "
    "2/3 of the step and is what an all-reduce can overlap; input pipeline never stalls."
)
MULTI_HOST_ASSUMPTIONS = (
    "as for one host, plus: network bandwidth per NIC at line rate (InfiniBand NDR 400 Gb/s "
    "= 50 GB/s, HDR 200 Gb/s = 25 GB/s, 100 GbE = 12.5 GB/s, 25 GbE = 3.125 GB/s; real "
    "transfers reach some 90 % of it) and per-hop latency 5 us (InfiniBand), 20 us (100 GbE), "
    "30 us (25 GbE, TCP-like); 'NIC per GPU' gives every GPU its own NIC (GPUDirect RDMA, "
    "rail-optimised, as DGX H100), 'NIC per node' makes a host's G GPUs share one; a "
    "non-blocking fabric (no congestion, no oversubscription); the flat ring is one ring "
    "paced by its slowest hop; the hierarchical all-reduce runs its three phases one after "
    "the other (no pipelining between them); no gradient compression; PCIe Gen3 x16 "
    "(Horovod comparison only): 12 GB/s, 10 us."
)

# Published measurements, for judging the model; not ours.
HOROVOD_PUBLISHED = {
    "source": (
        "Sergeev & Del Balso, 'Horovod: fast and easy distributed deep learning in "
        "TensorFlow', arXiv:1802.05799 (2018), Fig. 6: 128 Pascal GPUs (32 servers x 4), "
        "25 GbE TCP; Horovod docs/benchmarks.rst and README (github.com/horovod/horovod): "
        "'128 servers with 4 Pascal GPUs each connected by RoCE-capable 25 Gbit/s network. "
        "Horovod achieves 90% scaling efficiency for both Inception V3 and ResNet-101, and "
        "68% scaling efficiency for VGG-16.' tf_cnn_benchmarks, batch 64 per GPU."
    ),
    "hardware": {"gpus_per_host": 4, "gpu": "NVIDIA Pascal", "network": "25 GbE, one per host"},
    "efficiency": {
        # (model, GPUs): published scaling efficiency
        ("Inception V3", 128): 0.88,
        ("ResNet-101", 128): 0.88,
        ("Inception V3", 512): 0.90,
        ("ResNet-101", 512): 0.90,
        ("VGG-16", 512): 0.68,
    },
}
RESNET101_PARAMETERS = 44.5e6
# Assumed, not measured: a Pascal GPU trains ResNet-101 (fp32, batch 64) at about
# 115 images/s, i.e. 64 / 115 = 0.55 s a step. Horovod's benchmark page prints
# "total images/sec: 1656.82" for 16 GPUs as its example output: 104 per GPU.
HOROVOD_STEP_SECONDS = 0.55
# The comparison's cases: (hosts, GPUs per host, cluster: (link, network, NICs)).
PASCAL_25GBE = ("PCIe Gen3 x16", "25 GbE", "node")
HOROVOD_CASES = (
    (32, 4, "PCIe Gen3 + 25 GbE, NIC per node", PASCAL_25GBE),  # Horovod's own shape
    (128, 4, "PCIe Gen3 + 25 GbE, NIC per node", PASCAL_25GBE),
    (16, 8, "PCIe Gen3 + 25 GbE, NIC per node", PASCAL_25GBE),
    (64, 8, "PCIe Gen3 + 25 GbE, NIC per node", PASCAL_25GBE),
    (16, 8, "NVLink 4 + IB NDR, NIC per GPU", CLUSTERS["NVLink 4 + IB NDR, NIC per GPU"]),
    (64, 8, "NVLink 4 + IB NDR, NIC per GPU", CLUSTERS["NVLink 4 + IB NDR, NIC per GPU"]),
)


def allreduce_seconds(grad_bytes, devices, bandwidth, hop_latency):
    if devices == 1:
        return 0.0
    return (2 * (devices - 1) / devices * grad_bytes / bandwidth
            + 2 * (devices - 1) * hop_latency)


def flat_ring_seconds(grad_bytes, hosts, gpus_per_host, link, network):
    """One ring over all hosts x GPUs; `link` and `network` are (bandwidth, latency).

    2 x 2 GPUs, 1 GB of gradients, 100 GB/s inside a host, 10 GB/s between hosts:
    the ring's 6 steps move 250 MB each over its slowest (10 GB/s) hop.

    >>> round(flat_ring_seconds(1e9, 2, 2, (100e9, 0.0), (10e9, 0.0)), 6)
    0.15
    """
    devices = hosts * gpus_per_host
    if hosts == 1:
        bandwidth, latency = link
    elif gpus_per_host == 1:
        bandwidth, latency = network
    else:
        bandwidth, latency = min(link[0], network[0]), max(link[1], network[1])
    return allreduce_seconds(grad_bytes, devices, bandwidth, latency)


def hierarchical_seconds(grad_bytes, hosts, gpus_per_host, link, network, nic="gpu"):
    """Reduce-scatter in each host, all-reduce of 1/G across hosts, all-gather in each host.

    The same 2 x 2 GPUs: 5 ms to reduce-scatter, 50 ms across hosts (each GPU's
    own 10 GB/s NIC carries 2 * 1/2 * 500 MB), 5 ms to all-gather; with one NIC per
    host the two GPUs share it and the middle phase takes 100 ms.

    >>> round(hierarchical_seconds(1e9, 2, 2, (100e9, 0.0), (10e9, 0.0), "gpu"), 6)
    0.06
    >>> round(hierarchical_seconds(1e9, 2, 2, (100e9, 0.0), (10e9, 0.0), "node"), 6)
    0.11
    """
    if nic not in NICS:
        raise ValueError(f"nic must be 'gpu' or 'node'. Received: nic={nic!r}.")
    g, h = gpus_per_host, hosts
    (b_in, a_in), (b_net, a_net) = link, network
    inside = 0.0 if g == 1 else (g - 1) / g * grad_bytes / b_in + (g - 1) * a_in
    per_gpu = b_net if nic == "gpu" else b_net / g
    across = 0.0 if h == 1 else (2 * (h - 1) / h * (grad_bytes / g) / per_gpu
                                 + 2 * (h - 1) * a_net)
    return 2 * inside + across


def _efficiencies(compute_seconds, comm):
    exposed = max(0.0, comm - BACKWARD_FRACTION * compute_seconds)
    return (compute_seconds / (compute_seconds + comm),
            compute_seconds / (compute_seconds + exposed))


def project(compute_seconds, grad_bytes, counts=(2, 4, 8, 16), links=None):
    """Projected efficiency per link and device count, on one host.

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
            efficiency, overlap = _efficiencies(compute_seconds, comm)
            rows.append({
                "link": link, "devices": n, "allreduce_ms": 1000 * comm,
                "efficiency": efficiency, "efficiency_overlap": overlap,
            })
    return rows


def _resolve(cluster):
    """(link, network, nic) by name or as (bandwidth, latency) pairs."""
    link, network, nic = cluster
    if isinstance(link, str):
        link = {**LINKS, **OTHER_LINKS}[link]
    if isinstance(network, str):
        network = NETWORKS[network]
    return link, network, nic


def project_hosts(compute_seconds, grad_bytes, hosts=DEFAULT_HOSTS,
                  gpus_per_host=DEFAULT_GPUS_PER_HOST, clusters=None):
    """Projected flat-ring and hierarchical all-reduce per cluster and host count.

    `clusters` maps a name to (link, network, nic): names in LINKS (or
    OTHER_LINKS) and NETWORKS, or (bandwidth, latency) pairs; nic "gpu" or "node".

    A 100 ms step, 1 GB of gradients, 2 hosts x 2 GPUs (100 GB/s inside, a
    10 GB/s NIC per GPU between them): 150 ms flat, 60 ms hierarchical.

    >>> rows = project_hosts(0.1, 1e9, hosts=(2,), gpus_per_host=2,
    ...                      clusters={"x": ((100e9, 0.0), (10e9, 0.0), "gpu")})
    >>> r = rows[0]
    >>> r["gpus"], round(r["flat_ms"], 3), round(r["hierarchical_ms"], 3)
    (4, 150.0, 60.0)
    >>> round(r["efficiency_hierarchical"], 3), r["efficiency_hierarchical_overlap"]
    (0.625, 1.0)
    """
    rows = []
    for name, cluster in (clusters or CLUSTERS).items():
        link, network, nic = _resolve(cluster)
        for h in hosts:
            flat = flat_ring_seconds(grad_bytes, h, gpus_per_host, link, network)
            hier = hierarchical_seconds(grad_bytes, h, gpus_per_host, link, network, nic)
            flat_eff, flat_overlap = _efficiencies(compute_seconds, flat)
            hier_eff, hier_overlap = _efficiencies(compute_seconds, hier)
            rows.append({
                "cluster": name, "hosts": h, "gpus_per_host": gpus_per_host,
                "gpus": h * gpus_per_host, "nic": nic,
                "flat_ms": 1000 * flat, "hierarchical_ms": 1000 * hier,
                "efficiency_flat": flat_eff, "efficiency_flat_overlap": flat_overlap,
                "efficiency_hierarchical": hier_eff,
                "efficiency_hierarchical_overlap": hier_overlap,
            })
    return rows


def step_for_efficiency(comm_seconds, target=0.9):
    """The shortest compute step at which `comm_seconds` of all-reduce, not overlapped,
    keeps `target` efficiency: compute / (compute + t) >= target.

    >>> round(step_for_efficiency(0.01, 0.9), 9)  # 10 ms of all-reduce needs a 90 ms step
    0.09
    """
    return target / (1 - target) * comm_seconds


def horovod_comparison(parameters=RESNET101_PARAMETERS, step_seconds=HOROVOD_STEP_SECONDS):
    """Our model for a ResNet-101-sized gradient beside Horovod's published efficiency.

    The rows are modelled (fp32 gradients of `parameters`, `step_seconds` of
    compute per GPU, assumed); `published` is Horovod's measurement on its own
    hardware (4 Pascal GPUs per host, 25 GbE), where it has one at that GPU count.
    """
    grad_bytes = 4 * parameters
    published = HOROVOD_PUBLISHED["efficiency"]
    rows = []
    for hosts, gpus_per_host, name, cluster in HOROVOD_CASES:
        link, network, nic = _resolve(cluster)
        flat = flat_ring_seconds(grad_bytes, hosts, gpus_per_host, link, network)
        hier = hierarchical_seconds(grad_bytes, hosts, gpus_per_host, link, network, nic)
        flat_eff, flat_overlap = _efficiencies(step_seconds, flat)
        hier_eff, hier_overlap = _efficiencies(step_seconds, hier)
        gpus = hosts * gpus_per_host
        rows.append({
            "cluster": name, "hosts": hosts, "gpus_per_host": gpus_per_host, "gpus": gpus,
            "flat_ms": 1000 * flat, "hierarchical_ms": 1000 * hier,
            "efficiency_flat": flat_eff, "efficiency_flat_overlap": flat_overlap,
            "efficiency_hierarchical": hier_eff,
            "efficiency_hierarchical_overlap": hier_overlap,
            "step_ms_for_90_percent": 1000 * step_for_efficiency(min(flat, hier), 0.9),
            "published_resnet101": published.get(("ResNet-101", gpus)),
        })
    return {"parameters": parameters, "grad_bytes": grad_bytes,
            "step_ms": 1000 * step_seconds,
            "step_assumption": (
                f"{1000 * step_seconds:.0f} ms of compute per step per GPU, assumed (not "
                "measured): a Pascal GPU training ResNet-101 in fp32 at batch 64, about 115 "
                "images/s (Horovod's benchmark page shows 1656.82 images/s on 16 GPUs, 104 "
                "per GPU); the same step is kept for the NVLink rows, so they show the "
                "network alone; 'step for 90 %' is the compute step at which the faster "
                "all-reduce leaves 90 % without overlap"),
            "published": {f"{model} @ {gpus} GPUs": value
                          for (model, gpus), value in published.items()},
            "source": HOROVOD_PUBLISHED["source"], "rows": rows}

